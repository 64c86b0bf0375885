import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block, version_2_block

from kvpool.errors import ConfigError
from kvpool.store.codec import CODECS, LOSSY_BASE, get_codec
from kvpool.store.format import CorruptBlock, block_codec_id, decode_block, encode_block

ID = bytes(range(16))  # a block hash


def test_round_trip_preserves_bytes_shape_and_dtype():
    block = make_block(0)
    out = decode_block(encode_block(NAMESPACE, ID, block), NAMESPACE, SHAPE, DTYPE, ID)
    assert out.shape == SHAPE and out.dtype == DTYPE
    assert np.array_equal(out, block)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       dtype=st.sampled_from(["float16", "float32", "uint16", "int8"]))
def test_round_trip_any_shape_and_dtype(shape, dtype):
    block = (np.arange(int(np.prod(shape))) % 100).astype(dtype).reshape(shape)
    assert np.array_equal(decode_block(encode_block("ns", ID, block), "ns", tuple(shape), dtype, ID), block)


def test_non_contiguous_input_is_stored_contiguously():
    block = make_block(1)
    view = np.asfortranarray(block)
    assert np.array_equal(decode_block(encode_block(NAMESPACE, ID, view), NAMESPACE, SHAPE, DTYPE, ID), block)


@pytest.mark.parametrize("cut", [0, 10, 30, -1])
def test_truncated_block_is_corrupt(cut):
    data = encode_block(NAMESPACE, ID, make_block(2))
    with pytest.raises(CorruptBlock, match="bytes"):
        decode_block(data[:cut], NAMESPACE, SHAPE, DTYPE, ID)


def test_trailing_garbage_is_corrupt():
    data = encode_block(NAMESPACE, ID, make_block(2))
    with pytest.raises(CorruptBlock):
        decode_block(data + b"x", NAMESPACE, SHAPE, DTYPE, ID)


@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(pos, bit):
    data = bytearray(encode_block(NAMESPACE, ID, make_block(3)))
    data[pos % len(data)] ^= 1 << bit
    with pytest.raises(CorruptBlock):
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)


def test_wrong_namespace_is_corrupt():
    data = encode_block("other-model|float16|bs4|L2xKV2xD8", ID, make_block(4))
    with pytest.raises(CorruptBlock, match="namespace"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE, ID)


def test_wrong_shape_is_corrupt():
    data = encode_block(NAMESPACE, ID, make_block(5).reshape(2, 2, 2, 4, 8))
    with pytest.raises(CorruptBlock, match="shape"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE, ID)


def test_wrong_dtype_is_corrupt():
    data = encode_block(NAMESPACE, ID, make_block(6).view(np.uint16))
    with pytest.raises(CorruptBlock, match="dtype"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE, ID)


def test_bad_magic_is_corrupt():
    data = b"XXXX" + encode_block(NAMESPACE, ID, make_block(7))[4:]
    with pytest.raises(CorruptBlock, match="magic"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE, ID)


def test_decoding_never_unpickles():
    import pickle

    with pytest.raises(CorruptBlock):
        decode_block(pickle.dumps(make_block(8)), NAMESPACE, SHAPE, DTYPE, ID)


def test_a_block_stored_under_another_blocks_identity_is_refused():
    data = encode_block(NAMESPACE, ID, make_block(9))
    with pytest.raises(CorruptBlock, match="expected") as exc:
        decode_block(data, NAMESPACE, SHAPE, DTYPE, bytes(16))
    assert exc.value.reason == "identity"


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_format_block_is_unreadable(version):
    data = bytearray(version_2_block(make_block(10), ID))
    data[4:6] = version.to_bytes(2, "little")
    with pytest.raises(CorruptBlock, match=f"version {version}") as exc:
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)
    assert exc.value.reason == "version"


def reseal(data: bytearray) -> bytes:
    """`data` with its header CRC recomputed (as a writer that means it would)."""
    fixed = struct.calcsize("<4sHBBBBHHQQI")
    ndim, dlen, ilen, nlen, chunks = data[7], data[8], data[9], int.from_bytes(data[10:12], "little"), \
        int.from_bytes(data[12:14], "little")
    end = fixed + 8 * ndim + dlen + ilen + nlen + 8 * chunks
    crc = zlib.crc32(bytes(data[fixed:end]), zlib.crc32(bytes(data[: fixed - 4])))
    data[fixed - 4 : fixed] = struct.pack("<I", crc)
    return bytes(data)


def test_each_layer_carries_its_own_checksum():
    data = bytearray(encode_block(NAMESPACE, ID, make_block(11)))
    data[-3] ^= 0x01  # inside the last layer's bytes
    with pytest.raises(CorruptBlock, match=f"layer {SHAPE[0] - 1} checksum") as exc:
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)
    assert exc.value.reason == "checksum"


# -- codecs ----------------------------------------------------------------------------------

def smooth_block(seed: int) -> np.ndarray:
    """KV-like values with redundancy a lossless codec can find (few distinct exponents)."""
    return np.round(make_block(seed).astype(np.float32), 1).astype(DTYPE)


@pytest.mark.parametrize("codec", [c for c in CODECS if CODECS[c].lossless])
def test_every_lossless_codec_round_trips_exactly(codec):
    block = smooth_block(0)
    data = encode_block(NAMESPACE, ID, block, codec)
    assert block_codec_id(data) == CODECS[codec].id
    assert np.array_equal(decode_block(data, NAMESPACE, SHAPE, DTYPE, ID).view(np.uint16), block.view(np.uint16))
    if codec != "none":
        assert len(data) < len(encode_block(NAMESPACE, ID, block))


@settings(max_examples=30)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       dtype=st.sampled_from(["float16", "float32", "uint16", "int8"]),
       codec=st.sampled_from(["zstd", "zstd-shuffle"]))
def test_codecs_round_trip_any_shape_and_dtype(shape, dtype, codec):
    block = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    data = encode_block("ns", ID, block, codec)
    assert np.array_equal(decode_block(data, "ns", tuple(shape), dtype, ID), block)


def test_a_payload_the_codec_cannot_shrink_is_stored_raw():
    noise = np.random.default_rng(0).integers(0, 256, size=4096, dtype=np.uint8)
    data = encode_block("ns", ID, noise, "zstd")
    assert block_codec_id(data) == CODECS["none"].id
    assert np.array_equal(decode_block(data, "ns", (4096,), np.uint8, ID), noise)


@pytest.mark.parametrize("codec", ["zstd", "zstd-shuffle"])
def test_a_corrupted_compressed_payload_is_detected(codec):
    data = bytearray(encode_block(NAMESPACE, ID, smooth_block(1), codec))
    data[len(data) - 40] ^= 0x10  # inside the compressed stream
    with pytest.raises(CorruptBlock) as exc:
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)
    assert exc.value.reason in ("codec", "checksum")


@settings(max_examples=200)
@given(pos=st.integers(0, 100_000), bit=st.integers(0, 7), codec=st.sampled_from(["zstd", "zstd-shuffle"]))
def test_a_bit_flip_in_a_compressed_block_never_yields_other_bytes(pos, bit, codec):
    # A few bits of a zstd stream do not change what it decodes to (found: byte 16 of a
    # shuffled frame); such a block is still exactly right. Any other flip must be refused.
    block = smooth_block(2)
    data = bytearray(encode_block(NAMESPACE, ID, block, codec))
    data[pos % len(data)] ^= 1 << bit
    try:
        out = decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)
    except CorruptBlock:
        return
    assert out.tobytes() == block.tobytes()


@pytest.mark.parametrize("codec", ["zstd", "zstd-shuffle"])
def test_nearly_every_bit_flip_of_a_compressed_block_is_detected(codec):
    data = encode_block(NAMESPACE, ID, smooth_block(2), codec)
    detected = 0
    positions = range(0, len(data), max(1, len(data) // 300))
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        try:
            decode_block(bytes(flipped), NAMESPACE, SHAPE, DTYPE, ID)
        except CorruptBlock:
            detected += 1
    assert detected >= 0.95 * len(positions)


def test_the_reader_decodes_the_codec_the_header_names():
    block = smooth_block(3)
    packed = encode_block(NAMESPACE, ID, block, "zstd-shuffle")
    data = bytearray(packed)
    data[6] = CODECS["zstd"].id  # the header now names a codec the payload was not packed with
    with pytest.raises(CorruptBlock, match="header checksum"):  # the header CRC covers the codec id
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE, ID)
    data[6] = 63  # an id no codec has
    with pytest.raises(CorruptBlock, match="unknown codec id 63") as exc:
        decode_block(reseal(data), NAMESPACE, SHAPE, DTYPE, ID)
    assert exc.value.reason == "codec"
    assert np.array_equal(decode_block(packed, NAMESPACE, SHAPE, DTYPE, ID), block)


def test_codec_ids_tell_lossy_codecs_from_lossless_ones():
    assert all(c.lossless == (c.id < LOSSY_BASE) for c in CODECS.values())
    assert len({c.id for c in CODECS.values()}) == len(CODECS)


def test_an_unknown_codec_name_is_refused_by_name():
    with pytest.raises(ConfigError, match="'lz5'"):
        get_codec("lz5", "--kv-disk-codec")
