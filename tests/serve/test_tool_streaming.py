"""A forced tool call streams like vLLM's: the first chunk after the role carries the call's id
and name, then the arguments arrive in pieces while they are generated."""

from __future__ import annotations

import json

import pytest
from conftest import API_KEY

openai = pytest.importorskip("openai")

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_streams_its_name_first_then_argument_deltas(server, model_id, choice):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=WEATHER, tool_choice=choice, temperature=0, max_tokens=60, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    assert deltas[0].delta.role == "assistant"
    calls = [d.delta.tool_calls[0] for d in deltas[1:] if d.delta.tool_calls]
    head, pieces = calls[0], calls[1:]
    assert deltas[1].delta.tool_calls, "the first chunk after the role is the call's header"
    assert head.id and head.function.name == "get_weather" and head.type == "function"
    assert len(pieces) > 2 and all(p.id is None and p.function.name is None for p in pieces)
    arguments = "".join(p.function.arguments for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    assert deltas[-1].finish_reason == ("tool_calls" if choice == "required" else "stop")
