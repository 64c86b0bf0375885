"""Synthetic tokens, fast block hashing and the Mooncake trace loader."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.hashing import hash_blocks
from kvpool.errors import ConfigError
from kvpool.sim.tokens import BlockHasher, TokenSynth, name_blocks
from kvpool.sim.traces import TraceOptions, block_hashes_for, load_mooncake_trace, trace_path

# few chunk ids, so prompts share prefixes, shorter and longer runs of one chunk, carried-over tokens
chunk_lists = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 90)), min_size=1, max_size=6)


def _pattern(keys: list) -> list[int]:
    """Each key as the index of its first occurrence: which positions are equal to which."""
    first: dict = {}
    return [first.setdefault(k, i) for i, k in enumerate(keys)]


@settings(max_examples=80, deadline=None)
@given(st.lists(chunk_lists, min_size=2, max_size=5), st.sampled_from([2, 3, 16, 64]), st.sampled_from([32000, 128256]))
def test_block_keys_are_equal_exactly_where_chained_hashes_of_the_tokens_are(prompts, block_size, vocab):
    synth = TokenSynth(seed=5, vocab_size=vocab)
    hasher = BlockHasher(block_size, synth)
    keys = [hasher.hashes(tuple(chunks)) for chunks in prompts]
    digests = [hash_blocks(synth.tokens(chunks), block_size, namespace="m") for chunks in prompts]
    assert [len(k) for k in keys] == [len(d) for d in digests]
    assert _pattern([k for ks in keys for k in ks]) == _pattern([d for ds in digests for d in ds])
    assert [hasher.hashes(tuple(chunks)) for chunks in prompts] == keys  # named again: the same keys


def test_two_hashers_never_share_a_key():
    chunks = ((1, 64), (2, 40))
    first, second = (BlockHasher(16, TokenSynth()).hashes(chunks) for _ in range(2))
    assert len(first) == 6 and not set(first) & set(second)


def test_blocks_filled_past_a_hasher_key_get_new_keys_and_chains_from_the_root_stay_digests():
    tokens = list(range(40))
    assert name_blocks(tokens, 16) == hash_blocks(tokens, 16)  # a recomputed prompt hashes these again
    parent = BlockHasher(16, TokenSynth()).hashes(((1, 16),))[0]
    first, again = (name_blocks(tokens, 16, parent=parent, start_block=1) for _ in range(2))
    assert len(first) == len(again) == 1 and first != again  # placeholder tokens never repeat
    assert name_blocks(tokens, 16, parent=parent, start_block=1, limit=1) == []


def test_shorter_chunk_is_prefix_of_longer_chunk_with_same_id():
    synth = TokenSynth(seed=1)
    assert synth.tokens([(7, 100)])[:40] == synth.tokens([(7, 40)])
    assert synth.tokens([(7, 40)]) != synth.tokens([(8, 40)])
    assert TokenSynth(seed=2).tokens([(7, 40)]) != synth.tokens([(7, 40)])


@pytest.fixture(scope="module")
def conversation():
    return load_mooncake_trace("conversation")


def test_conversation_trace_has_12031_requests_in_time_order(conversation):
    assert len(conversation) == 12031
    assert conversation[0].arrival_s == 0
    arrivals = [r.arrival_s for r in conversation]
    assert arrivals == sorted(arrivals)
    assert all(sum(n for _, n in r.chunks) == r.prompt_len for r in conversation[:500])


def test_first_two_trace_requests_share_first_block_hash_only(conversation):
    first, second = conversation[0], conversation[1]
    assert first.chunks[0][0] == second.chunks[0][0] == 0
    h512 = block_hashes_for([first, second], 512)
    assert h512[0][0] == h512[1][0]
    assert h512[0][1] != h512[1][1]
    h16 = block_hashes_for([first, second], 16)
    assert h16[0][:32] == h16[1][:32] and h16[0][32] != h16[1][32]
    assert len(h16[0]) == 6758 // 16


def test_trace_options_scale_cap_truncate_and_speed_up():
    opts = TraceOptions(max_requests=50, speedup=10.0, scale_lengths=1 / 32, max_prompt_len=100)
    reqs = load_mooncake_trace("conversation", opts)
    full = load_mooncake_trace("conversation", TraceOptions(max_requests=50))
    assert len(reqs) == 50
    assert all(r.prompt_len <= 100 and sum(n for _, n in r.chunks) == r.prompt_len for r in reqs)
    assert reqs[0].chunks[0] == (0, 16)
    assert reqs[-1].arrival_s == pytest.approx(full[-1].arrival_s / 10)
    assert reqs[0].output_len == round(full[0].output_len / 32)


def test_a_repeated_trace_runs_its_copies_in_a_row_sharing_no_block():
    once = load_mooncake_trace("conversation", TraceOptions(max_requests=40))
    twice = load_mooncake_trace("conversation", TraceOptions(max_requests=40, repeat=2))
    assert len(twice) == 80 and twice[:40] == once
    period = once[-1].arrival_s + once[-1].arrival_s / 39  # the span plus one mean gap
    second = twice[40:]
    assert [r.arrival_s for r in second] == pytest.approx([r.arrival_s + period for r in once])
    assert [(r.prompt_len, r.output_len) for r in second] == [(r.prompt_len, r.output_len) for r in once]
    assert len({r.request_id for r in twice}) == 80
    keys = block_hashes_for(twice, 16)  # one hasher: equal blocks would share keys
    first_blocks = {h for hs in keys[:40] for h in hs}
    again = keys[40:]
    assert len(first_blocks) > 40 and not first_blocks & {h for hs in again for h in hs}
    assert [len(hs) for hs in again] == [len(hs) for hs in keys[:40]]
    with pytest.raises(ConfigError, match="repeat=0"):
        TraceOptions(repeat=0)


def test_trace_loader_errors_name_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="conversation"):
        trace_path(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="speedup"):
        TraceOptions(speedup=0)
