"""The frameworks users build on, unchanged, against a real `kvpool serve` with the bundled
model: each extracts a small pydantic object that validates (instructor's JSON-schema and tools
modes, LangChain's structured output and bound tools, litellm's pydantic response_format)."""

from __future__ import annotations

import pytest
from conftest import API_KEY
from pydantic import BaseModel

PROMPT = "Extract: Alice is 30 years old."  # one the bundled model completes at temperature 0
ALICE = {"name": "Alice", "age": 30}


class Person(BaseModel):
    name: str
    age: int


def _import(name: str):
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install -e '.[test]')")


def test_instructor_json_schema_and_tools_modes_extract_a_person(server, model_id):
    instructor = _import("instructor")
    openai = _import("openai")
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY), mode=mode)
        person = client.chat.completions.create(model=model_id, response_model=Person, max_retries=0,
                                                messages=[{"role": "user", "content": PROMPT}],
                                                temperature=0, max_tokens=60)
        assert person.model_dump() == ALICE, mode


@pytest.fixture
def chat_model(server, model_id):
    langchain_openai = _import("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, model=model_id,
                                       temperature=0, max_tokens=60)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_extracts_a_person(chat_model, method):
    person = chat_model.with_structured_output(Person, method=method).invoke(PROMPT)
    assert isinstance(person, Person) and person.model_dump() == ALICE


def test_langchain_bind_tools_returns_a_parsed_tool_call(chat_model):
    message = chat_model.bind_tools([Person], tool_choice="Person").invoke(PROMPT)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("Person", ALICE)]
    assert message.tool_calls[0]["id"]


def test_litellm_pydantic_response_format_extracts_a_person(server, model_id, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = _import("litellm")
    r = litellm.completion(model=f"openai/{model_id}", api_base=f"{server.url}/v1", api_key=API_KEY,
                           messages=[{"role": "user", "content": PROMPT}], response_format=Person,
                           temperature=0, max_tokens=60)
    assert Person.model_validate_json(r.choices[0].message.content).model_dump() == ALICE
    assert r.choices[0].finish_reason == "stop"

