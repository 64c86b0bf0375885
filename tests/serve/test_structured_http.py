"""Structured output over HTTP as vLLM shapes it: the issue's Person prompt gives valid JSON that
stops (flexible whitespace), compact JSON on request, and a schema that cannot be honoured is a
400 whose message names no dependency internals."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import AUTH

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "messages": [{"role": "user", "content": "Extract: Alice is 30 years old."}], "max_tokens": 60,
        "temperature": 0, **body})


def _person_format(schema=PERSON) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}}


def test_the_person_prompt_gives_json_that_validates_and_stops(server):
    r = _chat(server, response_format=_person_format())
    choice = r.json()["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"name": "Alice", "age": 30}
    assert choice["finish_reason"] == "stop"


def test_json_object_gives_an_object(server):
    r = _chat(server, response_format={"type": "json_object"}, max_tokens=40)
    text = r.json()["choices"][0]["message"]["content"]
    assert text.lstrip().startswith("{")


def test_disable_any_whitespace_gives_compact_json(server):
    r = _chat(server, response_format=_person_format(), structured_outputs={"disable_any_whitespace": True},
              max_tokens=12)
    text = r.json()["choices"][0]["message"]["content"]
    assert "\n" not in text and text.startswith('{"name": "')


@pytest.mark.parametrize("schema", [
    {"$ref": "http://127.0.0.1:19499/x.json"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # circular: xgrammar's own refusal
])
def test_a_schema_that_cannot_be_honoured_is_a_400_without_dependency_details(server, schema):
    r = _chat(server, response_format=_person_format(schema), max_tokens=4)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert ".cc" not in message and "/project" not in message and not any(c.isdigit() for c in message[:3])
