"""`kvpool bench kvstore --codecs ...`: bytes per block and save / load time per tier and codec.

The blocks are real KV: the model prefills `tokens` tokens of text (the package's own source
by default) and the bench stores exactly those blocks in each tier with each codec, then loads
them back (read + decode + checks) and verifies the bytes. Disk reads hit the page cache
(a warm disk, the best case for an uncompressed read); the remote tier is a local
redis-server over loopback (no network bandwidth to save). Times are the best of `repeats`.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.sched.sampling_params import SamplingParams
from kvpool.store.codec import get_codec
from kvpool.store.disk import DiskTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.tier import Tier


@dataclass(slots=True)
class CodecRow:
    tier: str
    codec: str
    dtype: str
    blocks: int
    raw_bytes_per_block: int
    bytes_per_block: float
    ratio: float
    save_ms_per_block: float
    load_ms_per_block: float


def real_blocks(base: EngineConfig, tokens: int) -> tuple[Engine, list[bytes], list[np.ndarray]]:
    """KV blocks the model computed for `tokens` tokens of real text (hashes and arrays)."""
    import torch

    from kvpool.engine.loader import load_model

    cfg = replace(base, kv_host_memory="4GiB", kv_disk_path=None, kv_remote=None,
                  num_blocks=tokens // base.block_size + 16, max_model_len=None)
    engine = Engine(cfg, loaded=load_model(base.model, dtype=getattr(torch, base.dtype)))
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).resolve().parents[1].rglob("*.py")))
    ids = engine.tokenizer.encode(text)[:tokens]
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    store = engine.kv_store.store
    store.flush()
    hashes = engine.scheduler.kv.prompt_hashes(ids)
    blocks = [np.array(b) for b in store.load(hashes)]
    return engine, hashes[: len(blocks)], blocks


def measure(tier: Tier, codec: str, engine: Engine, hashes: list[bytes], blocks: list[np.ndarray],
            repeats: int) -> CodecRow:
    store = engine.kv_store.store
    kv = TieredKVStore([tier], store.namespace, store.block_shape, store.dtype, codecs={tier.name: codec})
    start = time.perf_counter()
    for h, b in zip(hashes, blocks, strict=True):
        assert kv.save(h, b), f"{tier.name} refused a block"
    save_s = time.perf_counter() - start
    load_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = kv.load(hashes)
        load_s = min(load_s, time.perf_counter() - start)
        assert len(out) == len(blocks), f"{tier.name} lost blocks"
        exact = get_codec(codec).lossless  # a lossy codec's accuracy: kvpool bench kv-accuracy --store-codecs
        assert not exact or all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                for a, b in zip(out, blocks, strict=True)), "round trip differs"
    n = len(blocks)
    stored = tier.stats().bytes_written / n
    kv.close()
    return CodecRow(tier.name, codec, engine.config.dtype, n, blocks[0].nbytes, stored, blocks[0].nbytes / stored,
                    1e3 * save_s / n, 1e3 * load_s / n)


def run_codec_bench(base: EngineConfig, codecs: list[str], tiers: list[str], tokens: int,
                    json_path: str | None, repeats: int = 3) -> int:
    for c in codecs:
        get_codec(c, "--codecs")
    unknown = sorted(set(tiers) - {"disk", "remote"})
    if unknown:
        raise SystemExit(f"kvpool bench kvstore: unknown --codec-tiers {unknown}; choose disk, remote")
    engine, hashes, blocks = real_blocks(base, tokens)
    rows: list[CodecRow] = []
    with tempfile.TemporaryDirectory(prefix="kvpool-codec-") as tmp:
        if "disk" in tiers:
            for c in codecs:
                rows.append(measure(DiskTier(f"{tmp}/{c}", 1 << 40), c, engine, hashes, blocks, repeats))
        if "remote" in tiers:
            import redis

            from kvpool.store.remote_redis import RedisTier
            from kvpool.store.services import redis_service

            service = redis_service()
            service.start()
            try:
                for c in codecs:
                    redis.Redis(port=service.port).flushdb()  # SET NX would keep the previous codec's values
                    rows.append(measure(RedisTier(f"redis://127.0.0.1:{service.port}/0", timeout_s=5.0), c,
                                        engine, hashes, blocks, repeats))
            finally:
                service.stop()
    engine.close()
    print(f"{len(blocks)} real KV blocks of {blocks[0].nbytes} bytes ({base.dtype}, "
          f"{blocks[0].shape} per block); disk = page cache, remote = redis on loopback")
    print(f"{'tier':<7} {'codec':<13} {'bytes/block':>11} {'ratio':>6} {'save ms/blk':>11} {'load ms/blk':>11}")
    for r in rows:
        print(f"{r.tier:<7} {r.codec:<13} {r.bytes_per_block:>11.0f} {r.ratio:>6.3f} {r.save_ms_per_block:>11.3f} "
              f"{r.load_ms_per_block:>11.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2, sort_keys=True)
    return 0
