"""OpenAI's Responses API, GET /v1/models/{id} and system_fingerprint through the openai client
against a real `kvpool serve`."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import API_KEY, AUTH

openai = pytest.importorskip("openai")

WEATHER = [{"type": "function", "name": "get_weather", "description": "Get the weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


def test_plain_response_has_the_chat_answer_and_usage(client, model_id):
    question = "What is the capital of France? Answer in one word."
    r = client.responses.create(model=model_id, input=question, max_output_tokens=20, temperature=0)
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": question}],
                                          max_tokens=20, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_response_sends_the_api_events_in_order(client, model_id):
    stream = client.responses.create(model=model_id, input="Say hello.", max_output_tokens=12, temperature=0,
                                     stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 12 tokens cut it short
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text and final.incomplete_details.reason == "max_output_tokens"
    whole = client.responses.create(model=model_id, input="Say hello.", max_output_tokens=12, temperature=0)
    assert whole.output_text == text


def test_a_tool_call_comes_back_as_a_function_call_item_whole_and_streamed(client, model_id):
    ask = dict(model=model_id, input="What is the weather in Paris?", tools=WEATHER, tool_choice="required",
               temperature=0, max_output_tokens=60)
    r = client.responses.create(**ask)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(**ask, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and events[-1].type == "response.completed"
    follow = client.responses.create(model=model_id, temperature=0, max_output_tokens=30, tools=WEATHER,
                                     tool_choice="none", input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output_text


def test_text_format_json_schema_constrains_the_output(client, model_id):
    r = client.responses.create(model=model_id, input="Extract: Alice is 30 years old.", temperature=0,
                                max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "Person", "schema": PERSON}})
    assert json.loads(r.output_text) == {"name": "Alice", "age": 30} and r.status == "completed"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
])
def test_what_the_responses_route_cannot_honour_is_a_400_naming_it(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", headers=AUTH, json={"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_models_by_id_answers_the_card_or_an_openai_404(client, model_id):
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_system_fingerprint_is_one_stable_value_on_completions_chat_and_chunks(client, model_id):
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    again = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "yo"}], max_tokens=2)
    text = client.completions.create(model=model_id, prompt="hi", max_tokens=2)
    chunks = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    prints = {chat.system_fingerprint, again.system_fingerprint, text.system_fingerprint,
              *(c.system_fingerprint for c in chunks)}
    assert len(prints) == 1 and prints.pop().startswith("fp_")
