"""Native CPU kernels, compiled once per machine with torch's extension builder and cached.

Only what torch lacks lives here: a float32 matmul over 4-bit grouped weights (torch's own
int4 CPU kernel is vectorized for bf16 activations only, which would change the model's
numbers). If no compiler is at hand the engine keeps its dense float path.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4_linear.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


def build_dir() -> Path:
    base = Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")
    # -march=native: a cache shared between machines must not hand one CPU's build to another
    machine = f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {' '.join(FLAGS)}"
    digest = hashlib.sha256(SOURCE.read_bytes() + machine.encode())
    return base / "kernels" / digest.hexdigest()[:12]


@cache
def q4_linear_available() -> bool:
    """Build (first call on a machine: ~30 s) and register `torch.ops.kvpool.q4_linear`."""
    from torch.utils import cpp_extension

    path = build_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not any(path.glob("*.so")):
            logger.info("building the 4-bit CPU kernel (first run on this machine, about 30 s)")
        cpp_extension.load(
            name="kvpool_kernels",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            build_directory=str(path),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, read-only cache: stay on dense weights
        logger.warning("4-bit kernels unavailable (%s); using dense float weights", e)
        return False
    return True
