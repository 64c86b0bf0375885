"""The one validation station without a model: a stand-in tokenizer, the limits a server or the
gateway knows, and the refusals named by parameter."""

from __future__ import annotations

import pytest

from kvpool.engine.input_processor import InputLimits, InputProcessor
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams


class Words:
    """Token i is the i-th distinct word seen."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]


LIMITS = InputLimits(vocab_size=100, max_model_len=64, max_num_seqs=4, max_logprobs=5)


def refusal(processor: InputProcessor, prompt, params: SamplingParams | None = None, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        processor.process(prompt, params, **kw)
    return e.value


def test_a_valid_request_comes_out_on_token_ids():
    p = InputProcessor(Words(), LIMITS)
    req = p.process("a b a", SamplingParams(max_tokens=8), request_id="r", cache_salt="s")
    assert (req.prompt_token_ids, req.prompt, req.request_id, req.cache_salt) == ([0, 1, 0], "a b a", "r", "s")
    assert p.process([5, 6], None).params == SamplingParams()


@pytest.mark.parametrize(("prompt", "params", "param", "words"), [
    ([1, 2], SamplingParams(max_tokens=63), "max_tokens", "= 65 exceeds the model's context length of 64"),
    (list(range(64)), SamplingParams(max_tokens=1), "prompt", "context length of 64"),
    ("", SamplingParams(), "prompt", "prompt is empty"),
    ([1, 100], SamplingParams(), "prompt", "prompt: token id 100 is outside the vocabulary (0..99)"),
    ([1, -1], SamplingParams(), "prompt", "outside the vocabulary"),
    ([1, True], SamplingParams(), "prompt", "must be integers"),
    ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids", "token id 100 is outside"),
    ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias", "token id 100 is outside"),
    ([1], SamplingParams(logprobs=6), "logprobs", "logprobs must be <= 5, got 6"),
    ([1], SamplingParams(prompt_logprobs=6), "prompt_logprobs", "must be <= 5"),
    ([1], SamplingParams(n=5), "n", "n=5 sequences cannot run in one batch of at most 4"),
    ([1], SamplingParams(n=2, best_of=5), "best_of", "best_of=5"),
])
def test_a_bad_request_is_refused_by_name(prompt, params, param, words):
    e = refusal(InputProcessor(Words(), LIMITS), prompt, params)
    assert e.param == param and words in str(e)


def test_fields_assigned_after_construction_are_checked_again():
    params = SamplingParams()
    params.top_p = 0.0
    assert refusal(InputProcessor(Words(), LIMITS), [1], params).param == "top_p"
    assert refusal(InputProcessor(Words(), LIMITS), [1], "greedy").param == "params"  # type: ignore[arg-type]


def test_request_fields_are_typed():
    p = InputProcessor(Words(), LIMITS)
    assert refusal(p, [1], request_id=7).param == "request_id"
    assert refusal(p, [1], cache_salt=b"x").param == "cache_salt"
    assert refusal(p, [1], arrival_time=float("nan")).param == "arrival_time"


def test_unknown_limits_are_not_checked_and_the_cache_and_controls_are_asked_last():
    asked = []

    def capacity(prompt_len, params):
        asked.append(("capacity", prompt_len))

    def prepare(params):
        asked.append(("prepare", params.max_tokens))
        return "state"

    p = InputProcessor(Words(), InputLimits(), capacity=capacity, prepare=prepare)
    req = p.process([10**6] * 3, SamplingParams(max_tokens=10**5, logprobs=20))  # nothing known to refuse it
    assert req.controls == "state" and asked == [("capacity", 3), ("prepare", 10**5)]
    assert refusal(p, [], SamplingParams()).param == "prompt" and len(asked) == 2  # refused before asking
