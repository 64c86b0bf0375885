import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_helpers import DTYPE, NAMESPACE, SHAPE, make_block

from kvpool.store.format import CorruptBlock, decode_block, encode_block


def test_round_trip_preserves_bytes_shape_and_dtype():
    block = make_block(0)
    out = decode_block(encode_block(NAMESPACE, block), NAMESPACE, SHAPE, DTYPE)
    assert out.shape == SHAPE and out.dtype == DTYPE
    assert np.array_equal(out, block)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       dtype=st.sampled_from(["float16", "float32", "uint16", "int8"]))
def test_round_trip_any_shape_and_dtype(shape, dtype):
    block = (np.arange(int(np.prod(shape))) % 100).astype(dtype).reshape(shape)
    assert np.array_equal(decode_block(encode_block("ns", block), "ns", tuple(shape), dtype), block)


def test_non_contiguous_input_is_stored_contiguously():
    block = make_block(1)
    view = np.asfortranarray(block)
    assert np.array_equal(decode_block(encode_block(NAMESPACE, view), NAMESPACE, SHAPE, DTYPE), block)


@pytest.mark.parametrize("cut", [0, 10, 30, -1])
def test_truncated_block_is_corrupt(cut):
    data = encode_block(NAMESPACE, make_block(2))
    with pytest.raises(CorruptBlock, match="bytes"):
        decode_block(data[:cut], NAMESPACE, SHAPE, DTYPE)


def test_trailing_garbage_is_corrupt():
    data = encode_block(NAMESPACE, make_block(2))
    with pytest.raises(CorruptBlock):
        decode_block(data + b"x", NAMESPACE, SHAPE, DTYPE)


@given(pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_single_bit_flip_is_detected(pos, bit):
    data = bytearray(encode_block(NAMESPACE, make_block(3)))
    data[pos % len(data)] ^= 1 << bit
    with pytest.raises(CorruptBlock):
        decode_block(bytes(data), NAMESPACE, SHAPE, DTYPE)


def test_wrong_namespace_is_corrupt():
    data = encode_block("other-model|float16|bs4|L2xKV2xD8", make_block(4))
    with pytest.raises(CorruptBlock, match="namespace"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE)


def test_wrong_shape_is_corrupt():
    data = encode_block(NAMESPACE, make_block(5).reshape(2, 2, 2, 4, 8))
    with pytest.raises(CorruptBlock, match="shape"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE)


def test_wrong_dtype_is_corrupt():
    data = encode_block(NAMESPACE, make_block(6).view(np.uint16))
    with pytest.raises(CorruptBlock, match="dtype"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE)


def test_bad_magic_is_corrupt():
    data = b"XXXX" + encode_block(NAMESPACE, make_block(7))[4:]
    with pytest.raises(CorruptBlock, match="magic"):
        decode_block(data, NAMESPACE, SHAPE, DTYPE)


def test_decoding_never_unpickles():
    import pickle

    with pytest.raises(CorruptBlock):
        decode_block(pickle.dumps(make_block(8)), NAMESPACE, SHAPE, DTYPE)
