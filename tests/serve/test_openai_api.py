"""The server through the official `openai` client: shapes, streaming, sampling options."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import AUTH

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client, model_id):
    assert [m.id for m in client.models.list().data] == [model_id]


def test_completion_has_openai_shape_and_exact_length(client, model_id, server):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == model_id and r.id
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 7
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": PROMPT}).json()["tokens"]
    assert r.usage.prompt_tokens == len(tokens)


def test_greedy_completion_matches_offline_llm(client, model_id):
    from kvpool import LLM
    from kvpool.sched.sampling_params import SamplingParams

    llm = LLM(max_model_len=1024, num_blocks=64, dtype="float32")
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == offline.outputs[0].text


def test_token_id_prompts_and_batches_give_one_choice_per_prompt_and_sample(client, model_id, server):
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": PROMPT}).json()["tokens"]
    other = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": "Once upon a time"}).json()["tokens"]
    r = client.completions.create(model=model_id, prompt=[tokens, other], n=2,
                                  max_tokens=4, temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 4
    greedy = client.completions.create(model=model_id, prompt=[tokens], max_tokens=5, temperature=0)
    assert greedy.choices[0].text == client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text


def test_same_seed_gives_same_text(client, model_id):
    def run(seed: int) -> str:
        return client.completions.create(model=model_id, prompt="Tell me a story:", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text
    assert run(42) == run(42)


def test_streaming_completion_concatenates_to_the_whole_text(client, model_id):
    whole = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_string_ends_generation_and_is_not_streamed(client, model_id):
    base = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    stop = base.strip().split()[1] if len(base.split()) > 1 else base[-2:]
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop], stream=True))
    assert streamed == r.choices[0].text


def test_logprobs_are_returned_per_token(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 3 and max(t.values()) >= lp.token_logprobs[i] - 1e-4 for i, t in enumerate(lp.top_logprobs))


def test_echo_prepends_the_prompt(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)


def test_chat_completion_and_its_stream_agree(client, model_id):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_chat_n_samples_stream_each_choice(client, model_id):
    chunks = list(client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, n=3, temperature=1.0,
        seed=1, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_repeated_prompt_reports_cached_tokens(client, model_id):
    prompt = "A long shared system prompt that is reused across many requests. " * 6
    client.completions.create(model=model_id, prompt=prompt, max_tokens=1)
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_beam_search_returns_n_beams(client, model_id):
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, n=2, temperature=0,
                                  extra_body={"use_beam_search": True})
    assert len(r.choices) == 2 and all(c.finish_reason for c in r.choices)
