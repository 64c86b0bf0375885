"""Sampler filters on hand-made logits, seeds independent of the batch, greedy = argmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.kernels import fused_ops_available
from kvpool.engine.layers import fused_ops
from kvpool.engine.sampler import (
    RowParams,
    SamplingTensors,
    apply_filters,
    bad_word_bans,
    process_logits,
    sample,
    token_counts,
)
from kvpool.errors import InvalidRequest

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 in a shuffled order
PROBS = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])
LOGITS = PROBS.log().unsqueeze(0)


def kept(params: RowParams) -> set[int]:
    t = SamplingTensors.from_params([params], LOGITS.shape[-1], LOGITS.device)
    out = apply_filters(LOGITS, t)[0]
    return {i for i in range(out.numel()) if math.isfinite(out[i].item())}


def test_top_k_keeps_the_k_most_likely_tokens():
    assert kept(RowParams(top_k=2)) == {1, 3}
    assert kept(RowParams(top_k=1)) == {1}
    assert kept(RowParams(top_k=-1)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert kept(RowParams(top_p=0.5)) == {1}
    assert kept(RowParams(top_p=0.6)) == {1, 3}
    assert kept(RowParams(top_p=0.8)) == {0, 1, 3}
    assert kept(RowParams(top_p=0.01)) == {1}  # never empty


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert kept(RowParams(min_p=0.3)) == {1, 3}  # floor 0.15
    assert kept(RowParams(min_p=0.2)) == {0, 1, 3}  # floor 0.1


def test_filters_combine_per_row():
    t = SamplingTensors.from_params(
        [RowParams(top_k=3, top_p=0.6), RowParams(), RowParams(min_p=0.6)], 5, torch.device("cpu")
    )
    out = apply_filters(LOGITS.repeat(3, 1), t).isfinite()
    assert out.tolist() == [
        [False, True, False, True, False],
        [True] * 5,
        [False, True, False, False, False],
    ]


def test_greedy_rows_take_the_argmax_and_report_raw_logprobs():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    res = sample(logits, [RowParams(temperature=0.0, num_logprobs=3)] * 4)
    assert res.token_ids == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1)
    for i, tok in enumerate(res.token_ids):
        assert res.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert res.top_logprobs is not None and res.top_logprobs[i][0][0] == tok
        assert [t for t, _ in res.top_logprobs[i]] == ref[i].topk(3).indices.tolist()


def test_logprobs_ignore_temperature():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1))
    res = sample(logits, [RowParams(temperature=0.3)])
    assert res.logprobs[0] == pytest.approx(
        logits.log_softmax(-1)[0, res.token_ids[0]].item(), abs=1e-6
    )


def seeded_draws(seed: int, others: int, steps: int = 20) -> list[int]:
    """The seeded row's tokens over `steps` steps, sharing each batch with `others` unseeded rows."""
    gen = torch.Generator().manual_seed(seed)
    mine = torch.randn(steps, 100, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(steps, others, 100)
    at = others // 2
    out = []
    for s in range(steps):
        rows = torch.cat([noise[s, :at], mine[s : s + 1], noise[s, at:]])
        params = [RowParams(temperature=1.0, top_p=0.95)] * others
        params.insert(at, RowParams(temperature=1.0, top_p=0.95, generator=gen))
        out.append(sample(rows, params).token_ids[at])
    return out


def test_seeded_row_is_reproducible_regardless_of_other_rows():
    alone = seeded_draws(42, others=0)
    assert seeded_draws(42, others=5) == alone
    assert seeded_draws(43, others=0) != alone


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 30),
    p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    temp=st.floats(0.1, 2.0),
    seed=st.integers(0, 10_000),
)
def test_sampled_token_always_survives_every_filter(k, p, min_p, temp, seed):
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(seed)) * 3
    params = RowParams(
        temperature=temp,
        top_k=k,
        top_p=p,
        min_p=min_p,
        generator=torch.Generator().manual_seed(seed),
    )
    res = sample(logits, [params] * 3)
    t = SamplingTensors.from_params([params] * 3, 30, logits.device)
    allowed = apply_filters(logits, t).isfinite()
    assert all(allowed[i, tok] for i, tok in enumerate(res.token_ids))
    assert all(int(allowed[i].sum()) <= k for i in range(3))


def test_sampling_follows_the_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = LOGITS.repeat(4000, 1)
    res = sample(logits, [RowParams(generator=gen)] * 4000)
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=5).float() / 4000
    assert (freq - PROBS).abs().max() < 0.03


def test_bad_parameters_name_the_value():
    with pytest.raises(InvalidRequest, match="top_p=1.5"):
        RowParams(top_p=1.5)
    with pytest.raises(InvalidRequest, match="temperature=-1"):
        RowParams(temperature=-1)


# -- logit bias, penalties, banned tokens: batched code against a per-token reference ----------


def reference_processed(logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """One row, token by token, straight from the definitions (OpenAI / HF / vLLM)."""
    out = logits.clone().tolist()
    for tok, bias in (p.logit_bias or {}).items():
        out[tok] += min(max(bias, -100.0), 100.0)
    seen = set(p.prompt_ids) | set(p.output_ids)
    for tok in range(len(out)):
        if tok in seen:
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
        count = list(p.output_ids).count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        if tok in p.banned_token_ids:
            out[tok] = float("-inf")
    return torch.tensor(out)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.5, 2.0),
    bias=st.dictionaries(st.integers(0, 39), st.floats(-300, 300), max_size=4),
    prompt=st.lists(st.integers(0, 39), max_size=8),
    output=st.lists(st.integers(0, 39), max_size=12),
    banned=st.lists(st.integers(0, 39), max_size=3),
)
def test_processors_match_the_per_token_definitions(seed, presence, frequency, repetition, bias, prompt, output, banned):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed)) * 4
    rows = [
        RowParams(),
        RowParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                  logit_bias=bias, prompt_ids=prompt, output_ids=output, banned_token_ids=banned),
        RowParams(frequency_penalty=frequency, output_ids=output[::-1]),
    ]
    got = process_logits(logits, rows)
    for i, p in enumerate(rows):
        assert torch.allclose(got[i], reference_processed(logits[i], p), atol=1e-5), i


def test_logit_bias_minus_100_removes_the_greedy_token_and_plus_100_forces_one():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    greedy = logits.argmax(-1).tolist()
    res = sample(logits, [RowParams(temperature=0.0, logit_bias={greedy[0]: -100}),
                          RowParams(temperature=0.0, logit_bias={7: 100, 8: 1e9})])
    assert res.token_ids[0] == logits[0].topk(2).indices[1].item()  # the runner-up
    # 1e9 is clamped to +100 like the other, so the larger raw logit of the two wins
    assert res.token_ids[1] == (7 if logits[1, 7] > logits[1, 8] else 8)


def test_presence_and_frequency_penalties_steer_away_from_generated_tokens():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    assert sample(logits, [RowParams(temperature=0.0)]).token_ids == [0]
    # token 0 generated once: presence 1.0 drops it to 2.0 < 2.5
    assert sample(logits, [RowParams(temperature=0.0, presence_penalty=1.0, output_ids=[0])]).token_ids == [1]
    # frequency scales with the count: 0.3 * 1 keeps token 0, 0.3 * 2 does not
    assert sample(logits, [RowParams(temperature=0.0, frequency_penalty=0.3, output_ids=[0])]).token_ids == [0]
    assert sample(logits, [RowParams(temperature=0.0, frequency_penalty=0.3, output_ids=[0, 0])]).token_ids == [1]
    # negative penalties encourage repeats
    assert sample(logits, [RowParams(temperature=0.0, presence_penalty=-2, output_ids=[3])]).token_ids == [0]
    assert sample(logits, [RowParams(temperature=0.0, presence_penalty=-2, output_ids=[1])]).token_ids == [1]


def test_repetition_penalty_covers_the_prompt_and_divides_positive_multiplies_negative():
    logits = torch.tensor([[3.0, 2.5, -1.0, -1.2]])
    p = RowParams(temperature=0.0, repetition_penalty=1.5, prompt_ids=[0])
    assert sample(logits, [p]).token_ids == [1]  # 3 / 1.5 = 2 < 2.5
    out = process_logits(logits, [RowParams(repetition_penalty=2.0, output_ids=[2, 0])])
    assert out[0].tolist() == pytest.approx([1.5, 2.5, -2.0, -1.2])
    # presence/frequency see only the output: a prompt token is not penalised
    assert sample(logits, [RowParams(temperature=0.0, presence_penalty=2, prompt_ids=[0])]).token_ids == [0]


def test_banned_tokens_and_grammar_mask_are_never_sampled():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    allowed = torch.zeros(4, 30, dtype=torch.bool)
    allowed[:, 10:13] = True
    res = sample(logits, [RowParams(temperature=1.0, generator=torch.Generator().manual_seed(i)) for i in range(4)],
                 allowed=allowed)
    assert all(10 <= t < 13 for t in res.token_ids)
    greedy = logits.argmax(-1).tolist()
    res = sample(logits, [RowParams(temperature=0.0, banned_token_ids=[g]) for g in greedy])
    assert all(t != g for t, g in zip(res.token_ids, greedy, strict=True))


def test_reported_logprobs_are_the_raw_models_whatever_the_processors():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(2))
    res = sample(logits, [RowParams(temperature=0.0, logit_bias={4: 100}, presence_penalty=2, output_ids=[1])])
    assert res.token_ids == [4]
    assert res.logprobs[0] == pytest.approx(logits.log_softmax(-1)[0, 4].item(), abs=1e-6)


def test_bad_words_ban_the_last_token_only_where_the_word_would_complete():
    words = [[5], [7, 8, 9]]
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [1, 7]) == [5]
    assert bad_word_bans(words, [1, 7, 8]) == [5, 9]
    assert bad_word_bans([[7, 8, 9]], [8]) == []


def test_penalty_counts_are_one_scatter_per_batch():
    counts = token_counts([[1, 1, 3], [], [0]], 5, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0] * 5, [1, 0, 0, 0, 0]]


@pytest.mark.skipif(not fused_ops_available(), reason="fused CPU ops not built")
def test_native_sampling_ops_match_torchs_argmax_and_log_softmax():
    """The native argmax and log_softmax terms the sampler takes on CPU: torch's first-index
    ties, NaN as the maximum, masked (-inf) tokens, log_softmax's values; and a row's chosen
    logprob the same whether top logprobs are asked in its batch or not (batch invariance)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49157, generator=gen) * 4  # a vocabulary that leaves a tail past 16 lanes
    logits[1, 7] = logits[1, 40000] = 50.0  # a tie: the first wins
    logits[2, 49156] = 60.0  # the maximum in the tail
    logits[3, :] = float("-inf")
    logits[3, 12] = 1.0  # one allowed token
    logits[4, 100] = float("nan")
    logits[5, 3:] = float("-inf")
    chosen = fused_ops.argmax_rows(logits)
    assert torch.equal(chosen, logits.argmax(-1))
    ids = torch.cat([chosen[:, None], torch.randint(0, 49157, (6, 4), generator=gen)], 1)
    got = fused_ops.log_softmax_at(logits, ids)
    want = logits.log_softmax(-1).gather(-1, ids)
    assert torch.isnan(got[4]).all() and torch.isnan(want[4]).all()
    keep = torch.tensor([0, 1, 2, 3, 5])
    assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0, equal_nan=True)
    alone = sample(logits[keep], [RowParams(temperature=0.0)] * 5)
    assert alone.token_ids == chosen[keep].tolist()
    assert alone.logprobs == pytest.approx(want[keep, 0].tolist(), abs=1e-5)
    beside_top = sample(logits[keep], [RowParams(temperature=0.0, num_logprobs=i % 2 * 3) for i in range(5)])
    assert beside_top.logprobs == alone.logprobs  # bit for bit
    assert all(t[0] == (tok, lp) for t, tok, lp in zip(beside_top.top_logprobs[1::2], alone.token_ids[1::2],
                                                         alone.logprobs[1::2], strict=True))


@pytest.mark.skipif(not fused_ops_available(), reason="fused CPU ops not built")
def test_bf16_logits_read_as_they_are_give_the_float32_copys_tokens_and_logprobs():
    """A plain greedy batch reads the model's bf16 logits in place (no [N, V] float32 copy): the
    same tokens and logprobs, bit for bit, as the float32 copy gives, ties and the tail past 16
    lanes included, and as a batch whose other rows need the copy (a penalty, top logprobs)."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(5, 49157, generator=gen) * 4).bfloat16()
    logits[1, 7] = logits[1, 40000] = 50.0
    logits[2, 49156] = 60.0
    logits[3, 5:] = float("-inf")
    assert torch.equal(fused_ops.argmax_rows(logits), fused_ops.argmax_rows(logits.float()))
    ids = torch.randint(0, 49157, (5, 3), generator=gen)
    assert torch.equal(fused_ops.log_softmax_at(logits, ids), fused_ops.log_softmax_at(logits.float(), ids))
    greedy = [RowParams(temperature=0.0)] * 5
    as_is, copied = sample(logits, greedy), sample(logits.float(), greedy)
    assert as_is.token_ids == copied.token_ids == logits.float().argmax(-1).tolist()
    assert as_is.logprobs == copied.logprobs  # bit for bit
    mixed = sample(logits, greedy[:4] + [RowParams(temperature=0.0, num_logprobs=2)])
    assert mixed.token_ids == as_is.token_ids and mixed.logprobs == as_is.logprobs
