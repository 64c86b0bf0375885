"""The engine's sampling controls end to end on the bundled model, against transformers' logits:
penalties, logit_bias, bad_words, best_of, logprobs=0, structured outputs, prompt logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import step_until_done
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

PROMPT = "The best thing about the city of Paris is"


@pytest.fixture(scope="module")
def engine(loaded) -> Engine:
    return Engine(EngineConfig(dtype="float32", num_blocks=512, max_model_len=512, max_num_batched_tokens=512),
                  loaded=loaded)


def run(engine: Engine, prompt, params: SamplingParams):
    rid = engine.add_request(prompt, params)
    done = step_until_done(engine).get(rid)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.pool.num_blocks
    return done


def reference_greedy(hf_model, ids: list[int], steps: int, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding with transformers' logits and the penalties applied as defined."""
    ids = list(ids)
    prompt_len = len(ids)
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        out = ids[prompt_len:]
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[ids] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float() if out \
            else torch.zeros_like(logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        ids.append(int(logits.argmax()))
    return ids[prompt_len:]


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 0.8},
                                     {"repetition_penalty": 1.3}])
def test_each_penalty_changes_greedy_output_as_defined(engine, loaded, hf_model, penalty):
    ids = loaded.tokenizer.encode(PROMPT)
    plain = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    got = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty))
    ref = reference_greedy(hf_model, ids, 24, penalty.get("presence_penalty", 0.0),
                           penalty.get("frequency_penalty", 0.0), penalty.get("repetition_penalty", 1.0))
    assert got.outputs[0].token_ids == ref
    assert got.outputs[0].token_ids != plain.outputs[0].token_ids


def test_logit_bias_minus_100_removes_the_greedy_token(engine):
    first = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=1)).outputs[0].token_ids[0]
    out = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={str(first): -100}))
    assert first not in out.outputs[0].token_ids
    forced = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=3, logit_bias={42: 100}))
    assert forced.outputs[0].token_ids == [42, 42, 42]


def test_bad_words_never_appear(engine):
    text = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=16)).outputs[0].text
    word = text.split()[0]
    out = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=16, bad_words=[word]))
    assert word not in out.outputs[0].text.split()


def test_best_of_returns_the_best_of_its_samples_by_cumulative_logprob(engine):
    sampled = dict(temperature=1.0, max_tokens=8, seed=7)
    all3 = run(engine, PROMPT, SamplingParams(n=3, **sampled))
    best = run(engine, PROMPT, SamplingParams(n=1, best_of=3, **sampled))
    scores = sorted((o.cumulative_logprob, o.token_ids) for o in all3.outputs)
    assert len(best.outputs) == 1 and best.outputs[0].index == 0
    assert (best.outputs[0].cumulative_logprob, best.outputs[0].token_ids) == scores[-1]
    two = run(engine, PROMPT, SamplingParams(n=2, best_of=3, **sampled))
    assert [o.token_ids for o in two.outputs] == [scores[-1][1], scores[-2][1]]


def test_logprobs_zero_reports_the_sampled_tokens_logprob(engine):
    out = run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)).outputs[0]
    assert len(out.logprobs) == 4 and all(lp <= 0 for lp in out.logprobs)
    assert out.top_logprobs == [[]] * 4


def test_json_object_output_parses(engine):
    prompt = "Give a JSON object with a person's name and age:\n"
    out = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=120,
                                             structured_outputs={"json_object": True}))
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    assert isinstance(json.loads(out.outputs[0].text), dict | list)


def test_json_schema_output_validates_and_choice_is_one_of_them(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = run(engine, "A person as JSON:\n", SamplingParams(temperature=0.0, max_tokens=80,
                                                           structured_outputs={"json": schema}))
    value = json.loads(out.outputs[0].text)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)
    choices = ["positive", "negative", "neutral"]
    out = run(engine, "I loved this film. Sentiment:", SamplingParams(temperature=0.8, seed=3, max_tokens=10,
                                                                     structured_outputs={"choice": choices}))
    assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


def test_a_bad_constraint_or_bias_is_refused_before_queueing(engine):
    with pytest.raises(InvalidRequest, match="does not compile"):
        engine.add_request(PROMPT, SamplingParams(structured_outputs={"regex": "(oops"}))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request(PROMPT, SamplingParams(logit_bias={10**6: 1}))
    assert not engine.has_unfinished()


def hf_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [lp[j, ids[j + 1]].item() for j in range(len(ids) - 1)]


def test_prompt_logprobs_equal_a_forward_pass_cached_or_not_and_chunked(loaded, hf_model, engine):
    text = "Paris is the capital and most populous city of France, with an estimated population of two million."
    ids = loaded.tokenizer.encode(text)
    ref = hf_prompt_logprobs(hf_model, ids)
    params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2)
    run(engine, ids, SamplingParams(temperature=0.0, max_tokens=1))  # the prompt's blocks are now cached
    for eng in (engine, Engine(EngineConfig(dtype="float32", num_blocks=128, max_num_batched_tokens=16, max_num_seqs=4),
                               loaded=loaded)):
        out = run(eng, ids, params)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        assert out.prompt_logprobs[1:] == pytest.approx(ref, abs=1e-3)
        assert all(len(t) == 2 for t in out.prompt_top_logprobs[1:])
        assert out.prompt_top_logprobs[1][0][1] >= out.prompt_logprobs[1] - 1e-6
