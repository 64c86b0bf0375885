"""JSON constraints allow whitespace as vLLM's xgrammar backend does by default (the model may
write `{\n    "name": ...`), compact JSON on request; a schema that cannot be honoured is refused
with the library's message only."""

from __future__ import annotations

import json

import pytest

from kvpool.engine.structured import GrammarCompiler, library_message
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import StructuredOutputs

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
INDENTED = '{\n    "name": "Alice",\n    "age": 30\n}'


@pytest.fixture(scope="module")
def compiler(loaded) -> GrammarCompiler:
    return GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)


def accepts(compiler, tokenizer, spec: StructuredOutputs, text: str) -> bool:
    """Does the grammar take the text's tokens and then end?"""
    m = compiler.matcher(compiler.compile(spec))
    for tok in tokenizer.encode(text, add_special_tokens=False):
        if not m.inner.accept_token(tok):
            return False
    return m.inner.accept_token(compiler.stop_token_ids[0])


def test_json_schema_and_json_object_accept_indented_json_by_default(compiler, loaded):
    assert accepts(compiler, loaded.tokenizer, StructuredOutputs(json=PERSON), INDENTED)
    assert accepts(compiler, loaded.tokenizer, StructuredOutputs(json_object=True), INDENTED)


def test_disable_any_whitespace_forces_compact_json(compiler, loaded):
    compact = StructuredOutputs(json=PERSON, disable_any_whitespace=True)
    assert not accepts(compiler, loaded.tokenizer, compact, INDENTED)
    assert accepts(compiler, loaded.tokenizer, compact, json.dumps({"name": "Alice", "age": 30}))  # ", " and ": "


def test_json_object_must_be_an_object(compiler, loaded):
    assert not accepts(compiler, loaded.tokenizer, StructuredOutputs(json_object=True), "[1, 2]")


@pytest.mark.parametrize(("schema", "words"), [
    ({"$ref": "http://127.0.0.1:19499/x.json"}, "fetches no remote"),
    ({"properties": {"a": {"$ref": "other.json#/a"}}}, "fetches no remote"),
    ({"$ref": "#/$defs/missing", "$defs": {}}, "points to nothing"),
    ({"$ref": "#/definitions/a/1", "definitions": {"a": [{}]}}, "points to nothing"),
])
def test_a_ref_outside_the_schema_is_refused(compiler, schema, words):
    with pytest.raises(InvalidRequest, match=words):
        compiler.compile(StructuredOutputs(json=schema))


def test_a_ref_inside_the_schema_compiles(compiler):
    schema = {"type": "object", "properties": {"p": {"$ref": "#/$defs/p~1q"}}, "$defs": {"p/q": {"type": "integer"}}}
    compiler.compile(StructuredOutputs(json=schema))


def test_library_errors_carry_no_source_path_line_or_time(compiler):
    circular = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(StructuredOutputs(json=circular))
    message = str(e.value)
    assert "Circular $ref" in message
    assert ".cc" not in message and "/project" not in message and "[" not in message


def test_library_message_keeps_the_first_line_without_the_log_prefix():
    error = RuntimeError("[08:35:15] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3\nstack")
    assert library_message(error) == "Regex parsing error at position 3"
