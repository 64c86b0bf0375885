"""Native CPU kernels, compiled once per machine with torch's extension builder and cached.

Only what torch lacks lives here: float32 and bfloat16 matmuls over the checkpoint's own 4-bit
(Q4_1) and 8-bit (Q8_0) groups that use exactly the dense copy's weights (torch's int4 CPU
kernel takes its own packing and bf16 activations only, which would change the model's
numbers), paged attention that reads each sequence's K/V through its block table, and fused
per-layer elementwise ops for bf16 decode steps (dispatch, not arithmetic, is their cost). If no
compiler is at hand the engine keeps its dense float weights and its torch attention.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4_linear.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_ops.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


def build_dir(source: Path = SOURCE) -> Path:
    base = Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")
    # -march=native: a cache shared between machines must not hand one CPU's build to another
    machine = f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {' '.join(FLAGS)}"
    digest = hashlib.sha256(source.read_bytes() + machine.encode())
    return base / "kernels" / digest.hexdigest()[:12]


STALE_LOCK_S = 600  # a build takes ~30 s; an older lock was left by a builder that was killed


def _drop_stale_lock(lock: Path) -> None:
    """torch's builder waits forever on a lock file a killed build left behind: drop it."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a kernel build lock left %.0f s ago by a build that did not finish: %s", age, lock)
        lock.unlink(missing_ok=True)


def _build(name: str, source: Path) -> None:
    from torch.utils import cpp_extension

    path = build_dir(source)
    path.mkdir(parents=True, exist_ok=True)
    if not any(path.glob("*.so")):
        logger.info("building the %s CPU kernel (first run on this machine, about 30 s)", name)
    _drop_stale_lock(path / "lock")
    cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=FLAGS,
        build_directory=str(path),
        is_python_module=False,
        verbose=False,
    )


@cache
def q4_linear_available() -> bool:
    """Build (first call on a machine: ~30 s) and register `torch.ops.kvpool.q4_linear` / `q8_linear`."""
    try:
        _build("kvpool_kernels", SOURCE)
    except Exception as e:  # no compiler, no headers, read-only cache: stay on dense weights
        logger.warning("4-bit kernels unavailable (%s); using dense float weights", e)
        return False
    return True


@cache
def paged_attention_available() -> bool:
    """Build (first call on a machine: ~30 s) and register `torch.ops.kvpool_attn.paged_attention_out`."""
    if os.environ.get("KVPOOL_NATIVE_ATTENTION", "1") == "0":
        logger.info("native paged attention off (KVPOOL_NATIVE_ATTENTION=0); using the torch path")
        return False
    try:
        _build("kvpool_attn_kernels", ATTENTION_SOURCE)
    except Exception as e:  # no compiler, no headers, read-only cache: stay on torch attention
        logger.warning("native paged attention unavailable (%s); using the torch path", e)
        return False
    logger.info("native paged attention kernel loaded")
    return True


@cache
def fused_ops_available() -> bool:
    """Build (first call on a machine: ~30 s) and register `torch.ops.kvpool_fused.*`;
    `KVPOOL_FUSED_OPS=0` keeps torch's op-by-op path."""
    if os.environ.get("KVPOOL_FUSED_OPS", "1") == "0":
        return False
    try:
        _build("kvpool_fused_ops", FUSED_SOURCE)
    except Exception as e:  # no compiler, no headers, read-only cache: stay on torch ops
        logger.warning("fused per-layer ops unavailable (%s); using torch ops", e)
        return False
    return True
