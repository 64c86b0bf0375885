"""Sampler filters on hand-made logits, seeds independent of the batch, greedy = argmax."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.sampler import RowParams, SamplingTensors, apply_filters, sample
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
