"""Property: any JSON body to /v1/responses is a 200 or an OpenAI-shaped 4xx, never a 500; a
streamed 200 ends with response.completed or response.incomplete; the engine stays exact."""

from __future__ import annotations

import json

from conftest import KEYS
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_fuzz import REFERENCE, SAMPLING, values

AUTH = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}

part = st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["input_text", "output_text", "input_image"]), values),
                              "text": st.one_of(st.text(max_size=8), values)})
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": st.text(max_size=12)}),
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), values),
                           "content": st.one_of(st.text(max_size=12), st.lists(part, max_size=2), values)},
                          optional={"type": st.one_of(st.just("message"), values)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": values, "name": values,
                           "arguments": values}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": values, "output": values}),
    values,
)
tool = st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["function", "web_search"]), values),
                              "name": st.one_of(st.sampled_from(["f", "g"]), values)},
                             optional={"parameters": st.one_of(st.just({"type": "object", "properties": {
                                 "x": {"type": "boolean"}}}), values)})
FIELDS = {
    **{k: SAMPLING[k] for k in ("model", "temperature", "top_p", "stream", "store", "user", "metadata")},
    "instructions": st.one_of(st.text(max_size=10), values),
    "tools": st.one_of(st.lists(tool, max_size=2), values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])}),
                             values),
    "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]), "schema": values}), values)}), values),
    "previous_response_id": values, "truncation": values, "include": values, "reasoning": values,
    "parallel_tool_calls": values,
}
body_strategy = st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({
        "input": st.one_of(st.text(min_size=1, max_size=20), st.text(max_size=20), st.lists(item, max_size=3), values),
        "max_output_tokens": st.one_of(st.integers(1, 3), st.integers(-1, 3), values),
        **{k: FIELDS[k] for k in keys}}))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=body_strategy)
def test_any_responses_body_is_200_or_an_openai_4xx(inprocess, body):
    if type(body["max_output_tokens"]) is not int:  # wild values are refused; keep the rest short
        body["max_output_tokens"] = 2 if body["max_output_tokens"] is None else body["max_output_tokens"]
    r = inprocess[0].post("/v1/responses", content=json.dumps(body).encode(), headers=AUTH)
    event(f"HTTP {r.status_code}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    elif body.get("stream") is True:
        last = [line for line in r.text.splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete"), r.text[-500:]
    else:
        assert r.json()["object"] == "response"


def test_after_the_fuzzing_the_engine_is_healthy_and_its_pool_empty(inprocess):
    client, state = inprocess
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json=REFERENCE, headers=AUTH).status_code == 200
    usage = state.engine.engine.scheduler.kv.usage()
    assert usage.free_blocks == usage.total_blocks
