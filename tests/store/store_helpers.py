"""Block shapes and data shared by the store tests."""

import importlib.util
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.store.format import block_namespace, block_shape
from kvpool.store.services import LocalService, ServiceError, find_binary

SHAPE = block_shape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
DTYPE = np.dtype(np.float16)
NAMESPACE = block_namespace("test-model", "float16", 4, 2, 2, 8)


def make_block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(DTYPE)


def version_2_block(block: np.ndarray, block_id: bytes, namespace: str = NAMESPACE) -> bytes:
    """A block as format 2 wrote it: one CRC over the header and the whole raw payload."""
    fixed = struct.Struct("<4sHBBBBHQQI")
    ns = namespace.encode()
    variable = struct.pack(f"<{block.ndim}Q", *block.shape) + block.dtype.str.encode() + block_id + ns
    head = fixed.pack(b"KVPB", 2, 0, block.ndim, len(block.dtype.str), len(block_id), len(ns), block.nbytes,
                      block.nbytes, 0)[:-4]
    crc = zlib.crc32(block.tobytes(), zlib.crc32(variable, zlib.crc32(head)))
    return head + struct.pack("<I", crc) + variable + block.tobytes()


def _have(binary: str) -> bool:
    try:
        find_binary(binary)
    except ServiceError:
        return False
    return True


needs_redis = pytest.mark.skipif(not _have("redis-server"),
                                 reason="redis-server missing: run scripts/install_remote_pools.sh")
needs_mooncake = pytest.mark.skipif(
    not _have("mooncake_master") or importlib.util.find_spec("mooncake") is None,
    reason="mooncake missing: run scripts/install_remote_pools.sh",
)


def serve(service: LocalService) -> Iterator[LocalService]:
    """Run `service` for the duration of a `for` / `yield from` block, then stop it by pid."""
    service.start()
    try:
        yield service
    finally:
        service.stop()


def retry_until(action, attempts: int, pause_s: float, what: str) -> None:
    """Repeat `action()` until it returns true; a bounded wait for a restarted pool to be seen
    again (the tier backs off between reconnects), not a speed target."""
    for _ in range(attempts):
        if action():
            return
        time.sleep(pause_s)
    raise AssertionError(f"{what} did not recover after {attempts} attempts")


def race_put(writers, key: str, value: bytes) -> list[bool]:
    """Every writer puts the same immutable block at once; returns each put's result."""
    results: list[bool] = []
    threads = [threading.Thread(target=lambda w=w: results.append(w.put(key, value))) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
