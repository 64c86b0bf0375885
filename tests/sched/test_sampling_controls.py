"""SamplingParams' penalties, logit_bias, best_of, prompt_logprobs and structured outputs: bad values are refused by name."""

from __future__ import annotations

import pytest

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams, StructuredOutputs


def test_logit_bias_keys_from_json_become_token_ids():
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100, 7: 2.5}


@pytest.mark.parametrize(("values", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "a"}}, "logit_bias"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 17}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"bad_words": [""]}, "bad_words"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "choice"),
])
def test_bad_controls_are_refused_naming_the_parameter(values, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**values)
    assert e.value.param == param


def test_best_of_samples_more_than_it_returns():
    p = SamplingParams(n=2, best_of=5)
    assert (p.n, p.num_samples) == (2, 5)
    assert SamplingParams(n=3).num_samples == 3


def test_structured_outputs_from_a_dict_name_their_kind():
    assert SamplingParams(structured_outputs={"json_object": True}).structured_outputs.kind == "json_object"
    assert StructuredOutputs(choice=["yes", "no"]).kind == "choice"
