"""Tool calling (#19 item 3): forced calls (named, required) by constrained decoding, `auto` with
the hermes parser, streamed in OpenAI's delta format, and the 400s, with the official `openai`
client against a real `kvpool serve` (the bundled model, a few-shot template that makes it
answer a weather question with a hermes call). The parser itself is tested on strings, split at
every chunk size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, AUTH, Server, start_server

from kvpool.errors import InvalidRequest
from kvpool.serve.protocol import ChatCompletionRequest
from kvpool.serve.tools import ToolPlan

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = Path(__file__).parent / "data" / "hermes_fewshot.jinja"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


# -- the hermes parser and the plan, on strings -------------------------------------------------
def _plan(choice="auto", parallel=True, parser="hermes") -> ToolPlan:
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    req.check()
    return ToolPlan.of(req.tools, req.tool_choice, req.parallel_tool_calls, parser)


def _streamed(plan: ToolPlan, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) assembled from the deltas, as a client does."""
    s = plan.stream()
    pieces = [p for i in range(0, len(text), size) for p in s.feed(text[i:i + size])] + s.finish()
    content, calls = "", {}
    for p in pieces:
        content += p.get("content", "")
        for item in p.get("tool_calls", []):
            call = calls.setdefault(item["index"], ["", ""])
            call[0] += item["function"].get("name", "")
            call[1] += item["function"].get("arguments", "")
    return content, [tuple(calls[i]) for i in sorted(calls)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
ROME = ("get_weather", '{"city": "Rome", "unit": "celsius"}')
HERMES_CASES = [
    # text, content, calls
    (CALL, None, [ROME]),
    ("Let me check.\n" + CALL + "\n", "Let me check.", [ROME]),
    (CALL + "\n" + CALL.replace("Rome", "Oslo"), None, [ROME, ("get_weather", ROME[1].replace("Rome", "Oslo"))]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>', None,
     [("get_time", '{"zone": "UTC"}')]),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', None,
     [("get_time", '{"zone": "UTC"}')]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", '{"zone": "UTC"}')]),
    ("no call here <tool_call", "no call here <tool_call", []),
    ("a < b and <tool> tags\n\n", "a < b and <tool> tags\n\n", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UT', '<tool_call>{"name": "get_time", "arguments": {"zone": "UT', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_whole_and_split_at_every_chunk_size(text, content, calls):
    plan = _plan()
    got_content, got = plan.stream().message(text)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    for size in range(1, len(text) + 1):
        assert _streamed(plan, text, size) == (content or "", calls), size


def test_required_output_is_one_array_of_calls_streamed_call_by_call():
    plan = _plan("required")
    schema = plan.schema()
    text = '[{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}},{"name":"get_time","arguments":{"zone":"UTC"}}]'
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}}], schema)
    assert "maxItems" not in schema and _plan("required", parallel=False).schema()["maxItems"] == 1
    calls = [("get_weather", '{"city":"Rome","unit":"celsius"}'), ("get_time", '{"zone":"UTC"}')]  # as written
    for size in (1, 5, len(text)):
        assert _streamed(plan, text, size) == ("", calls)
    content, got = plan.stream().message('[{"name":"get_time","argu')  # cut by max_tokens: the call began
    assert (content, [(c.name, c.arguments) for c in got]) == (None, [("get_time", "")])
    content, got = plan.stream().message('[{"na')  # cut before any call began: the text is the content
    assert (content, got) == ('[{"na', [])
    assert plan.finish_reason("stop", True) == "tool_calls" and plan.finish_reason("length", False) == "length"


def test_named_plan_forces_the_function_schema_and_keeps_stop():
    plan = _plan({"type": "function", "function": {"name": "get_time"}})
    assert plan.schema() == TIME and plan.finish_reason("stop", True) == "stop"
    assert _streamed(plan, '{"zone":"UTC"}', 3) == ("", [("get_time", '{"zone":"UTC"}')])


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "other", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_tool_fields_are_checked_by_name(body, param):
    with pytest.raises(InvalidRequest) as e:
        ChatCompletionRequest(messages=ASK, **body).check()
    assert e.value.param == param


def test_auto_needs_a_parser_but_none_and_forced_calls_do_not():
    with pytest.raises(InvalidRequest, match="--tool-call-parser") as e:
        _plan("auto", parser=None)
    assert e.value.param == "tool_choice"
    assert _plan("none", parser=None).mode == "none" and _plan("none", parser=None).template_tools
    assert _plan("required", parser=None).mode == "required"


# -- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_server() -> Iterator[Server]:
    s = start_server("--api-key", API_KEY, "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                     "--chat-template", str(TEMPLATE), headers=AUTH)
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=kw.pop("messages", ASK), tools=TOOLS,
                                          temperature=0, max_tokens=kw.pop("max_tokens", 60), **kw)


def _assemble(stream) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason from OpenAI stream chunks, keyed by each delta's index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_tool_choice_returns_a_call_whose_arguments_validate(client, model):
    r = _chat(client, model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_returns_calls_of_the_given_functions_whose_arguments_validate(client, model):
    r = _chat(client, model, tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    one = _chat(client, model, tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_forced_calls_assemble_to_the_non_streamed_ones(client, model, choice):
    whole = _chat(client, model, tool_choice=choice).choices[0]
    content, calls, finish = _assemble(_chat(client, model, tool_choice=choice, stream=True))
    assert content == "" and finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)


def test_auto_parses_the_models_hermes_call_streamed_or_not(client, model):
    whole = _chat(client, model, tool_choice="auto").choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert whole.message.content is None
    content, calls, finish = _assemble(_chat(client, model, stream=True))  # auto is the default with tools
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_a_history_with_tool_calls_and_tool_results_is_rendered(client, model, tool_server):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
        {"role": "user", "content": "And in Oslo?"}]
    r = _chat(client, model, messages=history, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None
    rendered = httpx.post(f"{tool_server.url}/tokenize", headers=AUTH,
                          json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(f"{tool_server.url}/detokenize", headers=AUTH, json={"tokens": rendered}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text and "sunny, 24 C" in text
    assert "(get_weather, get_time)" in text  # the template received the tools


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
])
def test_bad_tool_requests_are_openai_style_400s(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, **body)
    err = e.value.body
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_the_default_id_is_the_file_name_and_the_path_is_an_alias(client, model):
    from kvpool.engine.loader import default_model_path

    path = default_model_path()
    assert model == path.stem  # no config hash
    r = client.chat.completions.create(model=str(path), messages=ASK, max_tokens=1)
    assert r.model == model
