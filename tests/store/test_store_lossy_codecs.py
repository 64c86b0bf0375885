"""Lossy store codecs (int8 / int4, + zstd): error bounds per group, bytes saved, and that a
quantized block is never taken for exact KV (header check, key spaces, tier moves)."""

import numpy as np
import pytest
import torch

from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError
from kvpool.store.codec import BY_ID, CODECS
from kvpool.store.disk import DiskTier
from kvpool.store.format import (
    CheckedBlock,
    CorruptBlock,
    block_codec_id,
    block_shape,
    decode_block,
    encode_block,
)
from kvpool.store.host import HostTier
from kvpool.store.kv_store import TieredKVStore
from kvpool.store.quant import from_float32, to_float32

ID = bytes(range(16))
REAL = block_shape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)  # SmolLM2-135M's blocks
LOSSY = [c for c in CODECS if not CODECS[c].lossless]


def kv_like(shape, seed: int = 0) -> np.ndarray:
    """float32 K/V with a few outlier channels in K (what per-channel K groups are for)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[:, 0, :, :, :3] *= 12.0
    return x


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_float32(x, np.dtype("<u2")) if dtype == "bfloat16" else x.astype(dtype)


def bound(x: np.ndarray, quant: str) -> np.ndarray:
    """Largest error each element may have: half a quantization step of its group."""
    if quant == "int8":
        return np.abs(x).max(axis=-1, keepdims=True) / 127 / 2 * np.ones_like(x)
    k, v = x[:, 0], x[:, 1]
    k_step = (k.max(axis=1, keepdims=True) - k.min(axis=1, keepdims=True)) / 15  # per channel over tokens
    v_step = (v.max(axis=-1, keepdims=True) - v.min(axis=-1, keepdims=True)) / 15  # per token and head
    return np.stack((np.broadcast_to(k_step, k.shape), np.broadcast_to(v_step, v.shape)), axis=1) / 2


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", LOSSY)
def test_a_lossy_round_trip_stays_within_half_a_step_of_each_group(codec, dtype):
    block = as_dtype(kv_like((4, 2, 16, 3, 64)), dtype)
    x = to_float32(block)
    out = decode_block(encode_block("ns", ID, block, codec), "ns", block.shape, block.dtype, ID,
                       CODECS[codec].quant.name)
    assert out.shape == block.shape and out.dtype == block.dtype
    err = np.abs(to_float32(out) - x)
    rounding = np.abs(x) * {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]  # into the block's dtype
    assert (err <= bound(x, CODECS[codec].quant.name) * 1.002 + rounding + 1e-6).all()
    assert err.max() > 0  # it is lossy


def test_int4_k_groups_follow_channels_not_tokens():
    x = kv_like((2, 2, 16, 3, 64), seed=1)
    out = to_float32(decode_block(encode_block("ns", ID, x, "int4"), "ns", x.shape, x.dtype, ID, "int4"))
    small = np.abs(out[:, 0, :, :, 3:] - x[:, 0, :, :, 3:]).max()  # an outlier channel's range stays its own
    assert small < np.abs(x[:, 0, :, :, :3]).max() / 15 / 2


def test_bfloat16_rounding_matches_torch():
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32) * 100
    expect = torch.from_numpy(x).to(torch.bfloat16).view(torch.uint16).numpy()
    assert np.array_equal(from_float32(x, np.dtype("<u2")), expect)


def test_int4_saves_at_least_3x_of_a_bfloat16_block_and_int8_nearly_2x():
    block = from_float32(kv_like(REAL), np.dtype("<u2"))
    raw = len(encode_block("ns", ID, block))
    assert raw / len(encode_block("ns", ID, block, "int4")) >= 3.0
    assert raw / len(encode_block("ns", ID, block, "int8")) >= 1.9


@pytest.mark.parametrize("codec", LOSSY)
def test_an_exact_reader_refuses_a_lossy_block_by_its_header(codec):
    block = kv_like((2, 2, 4, 2, 8))
    data = encode_block("ns", ID, block, codec)
    assert BY_ID[block_codec_id(data)].quant == CODECS[codec].quant  # (+zstd gives way when it cannot shrink)
    with pytest.raises(CorruptBlock, match="quantized") as exc:
        decode_block(data, "ns", block.shape, block.dtype, ID)
    assert exc.value.reason == "lossy"
    other = "int4" if CODECS[codec].quant.name == "int8" else "int8"
    with pytest.raises(CorruptBlock) as exc:
        decode_block(data, "ns", block.shape, block.dtype, ID, other)
    assert exc.value.reason == "lossy"


def test_a_lossy_reader_takes_an_exact_block_as_it_is():
    block = kv_like((2, 2, 4, 2, 8))
    out = decode_block(encode_block("ns", ID, block), "ns", block.shape, block.dtype, ID, "int4")
    assert np.array_equal(out, block)


def test_values_a_lossy_codec_cannot_carry_are_stored_exactly():
    block = kv_like((2, 2, 4, 2, 8))
    block[1, 1, 2, 0, 5] = np.inf
    data = encode_block("ns", ID, block, "int4+zstd")
    assert block_codec_id(data) == CODECS["none"].id
    assert np.array_equal(decode_block(data, "ns", block.shape, block.dtype, ID, "int4"), block)


def test_a_lossy_codec_for_quantized_or_odd_blocks_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="disk tier codec 'int4\\+zstd'.*int8"):
        TieredKVStore([DiskTier(str(tmp_path), 1 << 20)], "ns", (2, 2, 4, 2, 12), np.int8,
                      codecs={"disk": "int4+zstd"})
    with pytest.raises(ConfigError, match="int8 codec needs"):
        TieredKVStore([DiskTier(str(tmp_path), 1 << 20)], "ns", (4, 8), np.float32, codecs={"disk": "int8"})


SHAPE = (2, 2, 4, 2, 8)
HASHES = hash_blocks(list(range(4 * 6)), block_size=4, namespace="lossy")


def blocks(n: int) -> list[np.ndarray]:
    return [kv_like(SHAPE, seed=i) for i in range(n)]


def test_a_lossy_tier_serves_dequantized_blocks_under_keys_an_exact_store_never_reads(tmp_path):
    lossy = TieredKVStore([DiskTier(str(tmp_path), 1 << 24)], "ns", SHAPE, np.float32, codecs={"disk": "int4+zstd"})
    data = blocks(4)
    for h, b in zip(HASHES[:4], data, strict=True):
        assert lossy.save(h, b)
    lossy.flush()
    assert lossy.key(HASHES[0], "disk") != lossy.key(HASHES[0]) and ":int4:" in lossy.key(HASHES[0], "disk")
    out = lossy.load(HASHES[:4])
    assert len(out) == 4 and all(np.allclose(o, b, atol=0.5 * np.ptp(b)) and not np.array_equal(o, b)
                                 for o, b in zip(out, data, strict=True))
    assert lossy.stats()["disk"].lossy_loads == 4
    lossy.close()
    exact = TieredKVStore([DiskTier(str(tmp_path), 1 << 24)], "ns", SHAPE, np.float32)  # the same directory
    assert exact.lookup(HASHES[:4])[0] == 0 and exact.load(HASHES[:4]) == []
    exact.close()


def test_a_lossy_value_under_an_exact_key_is_a_miss_and_dropped(tmp_path):
    disk = DiskTier(str(tmp_path), 1 << 24)
    store = TieredKVStore([disk], "ns", SHAPE, np.float32)
    disk.put(store.key(HASHES[0]), encode_block("ns", HASHES[0], blocks(1)[0], "int8"))
    assert store.load(HASHES[:1]) == []
    assert store.stats()["disk"].bad_entries == {"lossy": 1}
    assert not disk.contains(store.key(HASHES[0]))
    store.close()


def test_a_lossy_disk_hit_is_not_promoted_into_the_exact_host_tier(tmp_path):
    host, disk = HostTier(1 << 24), DiskTier(str(tmp_path), 1 << 24)
    store = TieredKVStore([host, disk], "ns", SHAPE, np.float32, codecs={"disk": "int8+zstd"})
    b = blocks(1)[0]
    store.save(HASHES[0], b)
    host.delete(store.key(HASHES[0], "host"))
    (out,) = store.load(HASHES[:1])  # from disk, quantized
    assert not np.array_equal(out, b)
    assert not host.contains(store.key(HASHES[0], "host"))  # an approximation never becomes "exact"
    store.close()


def test_write_back_demotes_exact_host_blocks_into_a_lossy_disk_tier(tmp_path):
    block_bytes = len(encode_block("ns", HASHES[0], blocks(1)[0]))
    host, disk = HostTier(2 * block_bytes), DiskTier(str(tmp_path), 1 << 24)
    store = TieredKVStore([host, disk], "ns", SHAPE, np.float32, write_policy="write-back",
                          codecs={"disk": "int4"})
    data = blocks(4)
    for h, b in zip(HASHES[:4], data, strict=True):
        store.save(h, b)
    demoted = [h for h in HASHES[:4] if disk.contains(store.key(h, "disk"))]
    assert demoted and all(block_codec_id(disk.get(store.key(h, "disk"))) == CODECS["int4"].id for h in demoted)
    assert len(store.load(HASHES[:4])) == 4
    store.close()


def test_lossless_codecs_keep_the_exact_key_space():
    store = TieredKVStore([HostTier(1 << 20)], "ns", SHAPE, np.float32)
    assert store.key(HASHES[0], "host") == store.key(HASHES[0])
    store.close()


@pytest.mark.parametrize("codec, deferred", [("none", True), ("int4", True), ("int8", True), ("zstd", False)])
def test_a_deferred_load_leaves_decoding_to_the_reader_only_where_it_cannot_fail(tmp_path, codec, deferred):
    store = TieredKVStore([DiskTier(str(tmp_path), 1 << 24)], "ns", SHAPE, np.float32, codecs={"disk": codec})
    data = [np.round(b * 4) / 4 for b in blocks(2)]  # few distinct values: zstd shrinks them
    for h, b in zip(HASHES[:2], data, strict=True):
        store.save(h, b)
    eager = store.load(HASHES[:2])
    lazy = store.load(HASHES[:2], deferred=True)
    assert [isinstance(b, CheckedBlock) for b in lazy] == [deferred] * 2
    for e, z in zip(eager, lazy, strict=True):
        assert all(np.array_equal(e[layer], z[layer]) for layer in range(SHAPE[0]))
        assert np.array_equal(e[1, 0], z[1, 0]) and np.array_equal(np.asarray(z), e)
    store.close()
