"""Native CPU kernels, compiled once per machine with torch's extension builder and cached.

Only what torch lacks lives here: float32 and bfloat16 matmuls over the checkpoint's own 4-bit
(Q4_1) and 8-bit (Q8_0) groups that use exactly the dense copy's weights (torch's int4 CPU
kernel takes its own packing and bf16 activations only, which would change the model's
numbers), paged attention that reads each sequence's K/V through its block table, and fused
per-layer elementwise ops (in decode dispatch is their cost, in prefill the memory passes of
torch's op chain), and one op that runs a decode step's layer loop over those kernels. If no
compiler is at hand the engine keeps its dense float weights and its torch attention.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4_linear.cpp")
ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_ops.cpp")
LOOP_SOURCE = Path(__file__).with_name("layer_loop.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


def build_dir(source: Path = SOURCE) -> Path:
    base = Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")
    # -march=native: a cache shared between machines must not hand one CPU's build to another
    machine = f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {' '.join(FLAGS)}"
    # the source's path too: torch's build.ninja names it, so two checkouts sharing one
    # directory would rebuild each other's kernel at every start
    digest = hashlib.sha256(source.read_bytes() + machine.encode() + str(source.resolve()).encode())
    for header in sorted(source.parent.glob("*.h")):  # what the sources include: a change rebuilds
        digest.update(header.read_bytes())
    return base / "kernels" / digest.hexdigest()[:12]


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold an advisory lock on the build directory while building. The kernel releases it when
    its holder dies, so torch's own lock file found while holding it was left by a builder that
    was killed: torch would wait on it forever, so it is removed."""
    with open(path / "kvpool.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = path / "lock"
        if stale.exists():
            logger.warning("removing a kernel build lock left by a build that did not finish: %s", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str, source: Path) -> None:
    from torch.utils import cpp_extension

    path = build_dir(source)
    path.mkdir(parents=True, exist_ok=True)
    if not any(path.glob("*.so")):
        logger.info("building the %s CPU kernel (first run on this machine, about 30 s)", name)
    with _build_lock(path):
        cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=FLAGS,
            build_directory=str(path),
            is_python_module=False,
            verbose=False,
        )


def _available(name: str, source: Path, what: str, fallback: str, switch: str | None = None) -> bool:
    """Build `source` (first call on a machine: ~30 s) unless the env switch is "0"; on any
    build failure (no compiler, no headers, read-only cache) log and let the caller fall back."""
    if switch is not None and os.environ.get(switch, "1") == "0":
        logger.info("%s off (%s=0); using %s", what, switch, fallback)
        return False
    try:
        _build(name, source)
    except Exception as e:
        logger.warning("%s unavailable (%s); using %s", what, e, fallback)
        return False
    return True


@cache
def batch_invariant() -> bool:
    """Whether every row's result must be a function of that row alone (docs/determinism.md):
    the default. `KVPOOL_BATCH_INVARIANT=0` keeps the earlier per-row-count kernels, for
    measuring what invariance costs."""
    on = os.environ.get("KVPOOL_BATCH_INVARIANT", "1") != "0"
    if not on:
        logger.warning("KVPOOL_BATCH_INVARIANT=0: a request's results may depend on what it is batched with")
    return on


@cache
def q4_lanes_available(float32: bool = False) -> bool:
    """`torch.ops.kvpool.q4_repack` / `q8_repack` and the lanes kernels: rows over 4-bit and
    8-bit groups in oneDNN's summation order, bf16 (AVX512-BF16 builds) or float32 (AVX2 + FMA)."""
    return q4_linear_available() and bool(torch.ops.kvpool.lanes_available(float32))


@cache
def q4_linear_available() -> bool:
    """`torch.ops.kvpool.q4_linear` / `q8_linear`: 4-bit and 8-bit grouped weights."""
    return _available("kvpool_kernels", SOURCE, "4-bit kernels", "dense float weights")


@cache
def q4_amx_available() -> bool:
    """`torch.ops.kvpool.q4_linear_amx` / `q8_linear_amx`: the groups dequantized into AMX tiles
    (bf16). Needs the kernel built with AMX and Linux's grant of the tile state; logs why not.
    `KVPOOL_AMX_KERNELS=0` keeps mid-size batches on the dense path."""
    if os.environ.get("KVPOOL_AMX_KERNELS", "1") == "0":
        logger.info("AMX 4-bit kernels off (KVPOOL_AMX_KERNELS=0); mid-size bf16 batches use the dense path")
        return False
    if not q4_linear_available():
        return False
    reason = torch.ops.kvpool.amx_unavailable()
    if reason:
        logger.info("AMX 4-bit kernels unavailable (%s); mid-size bf16 batches use the dense path", reason)
    return not reason


@cache
def paged_attention_available() -> bool:
    """`torch.ops.kvpool_attn.paged_attention_out`; `KVPOOL_NATIVE_ATTENTION=0` keeps torch's path."""
    ok = _available("kvpool_attn_kernels", ATTENTION_SOURCE, "native paged attention", "the torch path",
                    "KVPOOL_NATIVE_ATTENTION")
    if ok:
        logger.info("native paged attention kernel loaded")
    return ok


@cache
def fused_ops_available() -> bool:
    """`torch.ops.kvpool_fused.*`; `KVPOOL_FUSED_OPS=0` keeps torch's op-by-op path."""
    return _available("kvpool_fused_ops", FUSED_SOURCE, "fused per-layer ops", "torch ops", "KVPOOL_FUSED_OPS")


@cache
def decode_loop_available() -> bool:
    """`torch.ops.kvpool_loop.decode_layers`: the layer loop over the kernels above, which it
    calls through the dispatcher (so they load first); `KVPOOL_DECODE_LOOP=0` keeps Python's."""
    if not (q4_linear_available() and paged_attention_available() and fused_ops_available()):
        return False
    return _available("kvpool_layer_loop", LOOP_SOURCE, "the native decode layer loop", "the Python layer loop",
                      "KVPOOL_DECODE_LOOP")
