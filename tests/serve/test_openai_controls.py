"""Sampling controls, structured output and prompt logprobs through the official `openai` client
against a real `kvpool serve` (float32, the session server), checked against kvpool's own engine
offline and transformers in fp32 on the same weights (#19)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import AUTH

from kvpool.sched.sampling_params import SamplingParams

# long enough (> one 16-token block) for a prefix-cache hit, unlikely in any other test
PROMPT = "In the small harbour town the fishermen mended their nets while the gulls circled overhead and"
REPEATS = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm():
    """kvpool's offline engine on the same weights in float32: the direct forward pass."""
    from kvpool import LLM

    return LLM(max_model_len=1024, num_blocks=64, dtype="float32")


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": text}).json()["tokens"]


def greedy(client, model_id: str, prompt: str = REPEATS, **kw):
    body = {"model": model_id, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True, **kw.pop("extra_body", {})}, **kw}
    return client.completions.create(**body).choices[0]


def offline(llm, prompt: str, **params):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **params})
    return llm.generate(prompt, sp, use_tqdm=False)[0]


# -- prompt logprobs ---------------------------------------------------------------------------
def test_echo_logprobs_equal_the_engine_and_transformers_cached_or_not(client, model_id, server, llm, hf_model):
    import torch

    ids = tokenize(server, PROMPT)
    assert len(ids) > 16
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    hf = torch.log_softmax(logits, -1)
    hf_lps = [hf[i - 1, ids[i]].item() for i in range(1, len(ids))]
    ref = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert ref.prompt_logprobs[0] is None and len(ref.prompt_logprobs) == len(ids)

    def score():
        return client.completions.create(model=model_id, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)

    uncached = score()
    greedy(client, model_id, PROMPT)  # the prompt's blocks are now in the prefix cache
    again = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # a hit is there to be (mis)used
    cached = score()
    for r in (uncached, cached):
        c = r.choices[0]
        assert c.text == PROMPT and r.usage.completion_tokens == 0
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref.prompt_logprobs[1:], strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], hf_lps, strict=True)) < 1e-3
        for i in range(1, len(ids)):  # the prompt token and the model's own top-1 (as vLLM sends)
            top = lp.top_logprobs[i]
            assert top[lp.tokens[i]] == lp.token_logprobs[i]
            assert max(top.values()) == pytest.approx(hf[i - 1].max().item(), abs=1e-3)
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]


def test_echo_with_generated_tokens_and_streamed_echo_agree(client, model_id, server):
    plain = greedy(client, model_id, PROMPT, max_tokens=4, logprobs=0)
    whole = greedy(client, model_id, PROMPT, max_tokens=4, logprobs=2, echo=True)
    n = len(tokenize(server, PROMPT))
    assert whole.text == PROMPT + plain.text
    assert len(whole.logprobs.tokens) == n + 4
    assert whole.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert whole.logprobs.text_offset[n] == len(PROMPT)
    stream = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the first chunk is the echo, with its logprobs
    assert "".join(ch.choices[0].text for ch in chunks) == whole.text
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    assert [x for ch in chunks for x in ch.choices[0].logprobs.text_offset] == whole.logprobs.text_offset
    only = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in only) == PROMPT and only[-1].choices[0].finish_reason == "length"


def test_vllm_prompt_logprobs_extra(client, model_id, server):
    ids = tokenize(server, PROMPT)
    echo = client.completions.create(model=model_id, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    c = r.choices[0]
    assert c.text and not c.text.startswith(PROMPT)  # no echo: only the field
    plps = c.model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    for i in range(1, len(ids)):
        entry = plps[i]
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(echo.choices[0].logprobs.token_logprobs[i], abs=1e-5)
        assert sorted(v["rank"] for v in entry.values() if v["rank"] is not None) == [1, 2]
        assert len(entry) == (2 if mine["rank"] is not None else 3)


# -- structured output ------------------------------------------------------------------------
def test_json_object_output_parses(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}],
        response_format={"type": "json_object"}, max_tokens=30, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "adult": {"type": "boolean"},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "adult", "pet"], "additionalProperties": False,
}


def test_json_schema_output_validates(client, model_id):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Invent a person and their pet."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        max_tokens=40, temperature=0.7, seed=5)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_vllm_guided_extras_constrain_completions(client, model_id):
    choice = greedy(client, model_id, "The best pet is", extra_body={"guided_choice": ["cat", "dog", "fish"]})
    assert choice.text in {"cat", "dog", "fish"} and choice.finish_reason == "stop"
    regex = greedy(client, model_id, "My phone number is", extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.text), regex.text
    same = greedy(client, model_id, "My phone number is",
                  extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert same.text == regex.text
    grammar = greedy(client, model_id, "Answer yes or no:", extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert grammar.text in {"yes", "no"}


# -- penalties and biases ---------------------------------------------------------------------
def _repeats(tokens: list[str]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.mark.parametrize(("openai_kw", "extra"), [({"presence_penalty": 2.0}, {}), ({"frequency_penalty": 2.0}, {}),
                                                  ({}, {"repetition_penalty": 2.0})])
def test_each_penalty_changes_greedy_output_as_the_engine_defines(client, model_id, llm, openai_kw, extra):
    base = greedy(client, model_id, logprobs=0)
    penalized = greedy(client, model_id, logprobs=0, extra_body=extra, **openai_kw)
    params = {**openai_kw, **extra}
    assert penalized.text == offline(llm, REPEATS, **params).outputs[0].text
    assert penalized.text != base.text
    assert _repeats(penalized.logprobs.tokens) < _repeats(base.logprobs.tokens)


def test_logit_bias_minus_100_removes_the_greedy_token_and_plus_100_forces_one(client, model_id, server, llm):
    base = greedy(client, model_id, PROMPT, max_tokens=1)
    first = tokenize(server, PROMPT + base.text)[len(tokenize(server, PROMPT))]
    banned = greedy(client, model_id, PROMPT, max_tokens=1, logit_bias={str(first): -100}, logprobs=3)
    assert banned.text != base.text
    assert banned.text == offline(llm, PROMPT, max_tokens=1, logit_bias={first: -100}).outputs[0].text
    forced_id = tokenize(server, " zebra")[0]
    forced = greedy(client, model_id, PROMPT, max_tokens=3, logit_bias={str(forced_id): 100})
    assert tokenize(server, forced.text) == [forced_id] * 3


def test_bad_words_are_never_generated(client, model_id):
    base = greedy(client, model_id)
    word = base.text.split()[0]
    banned = greedy(client, model_id, extra_body={"bad_words": [word]})
    assert word not in banned.text.split() and banned.text != base.text


def test_best_of_returns_the_best_of_the_candidates_by_cumulative_logprob(client, model_id):
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 11, "logprobs": 0,
            "extra_body": {"ignore_eos": True}}
    candidates = client.completions.create(n=3, **body).choices
    sums = [sum(c.logprobs.token_logprobs) for c in candidates]
    assert len({c.text for c in candidates}) > 1  # distinct candidates: the choice means something
    best = client.completions.create(n=1, best_of=3, **body).choices
    assert len(best) == 1
    assert best[0].text == candidates[max(range(3), key=sums.__getitem__)].text
    assert sum(best[0].logprobs.token_logprobs) == pytest.approx(max(sums), abs=1e-5)
    two = client.completions.create(n=2, best_of=3, **body).choices
    ranked = sorted(range(3), key=lambda i: -sums[i])[:2]
    assert [c.text for c in two] == [candidates[i].text for i in ranked]


def test_best_of_above_n_refuses_to_stream(server, model_id):
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={
        "model": model_id, "prompt": "hi", "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


# -- what stays as it was ------------------------------------------------------------------------
def test_unknown_fields_are_ignored(client, model_id):
    ignored = {"store": True, "user": "someone", "parallel_tool_calls": False, "reasoning_effort": "low"}
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = [client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=extra).choices[0].message.content for extra in ({}, ignored)]
    assert chat[0] == chat[1]
    comp = [greedy(client, model_id, extra_body=extra).text for extra in ({}, ignored)]
    assert comp[0] == comp[1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ending_on_the_last_allowed_token_is_trimmed_with_stop(client, model_id, stream):
    full = greedy(client, model_id, PROMPT, max_tokens=6).text
    stop = full[-3:]
    assert full.find(stop) == len(full) - 3
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": [stop],
            "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(client.completions.create(stream=True, **body))
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        c = client.completions.create(**body).choices[0]
        text, reason = c.text, c.finish_reason
    assert (text, reason) == (full[:-3], "stop")


def test_wrong_types_of_controls_are_400_naming_the_param(server, model_id):
    for field, value in [("presence_penalty", "high"), ("logit_bias", {"5": "x"}), ("logit_bias", {"x": 1}),
                         ("response_format", {"type": "yaml"}), ("best_of", 1.5), ("guided_choice", "cat"),
                         ("prompt_logprobs", True), ("bad_words", [1])]:
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                       json={"model": model_id, "prompt": "hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
