"""Pure pieces: keys and tenant salts, and the protocol's refusals, without a server."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from kvpool.engine.input_processor import InputLimits, InputProcessor
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.serve.auth import KeyRing, add_auth_arguments, effective_salt, keyring_from_args
from kvpool.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvpool.serve.sampling_map import set_controls


def test_each_key_is_its_own_tenant_and_the_salt_does_not_reveal_the_key():
    ring = KeyRing.build(["alpha", "beta"])
    a, b = ring.tenant(b"alpha"), ring.tenant(b"beta")
    assert a is not None and b is not None and a.salt != b.salt
    assert "alpha" not in a.salt and ring.tenant(b"alphA") is None and ring.tenant(b"") is None
    assert KeyRing.build(["alpha"]).tenant(b"alpha") == a  # stable across processes (conductor = instance)


def test_salts_scope_the_cache_unless_the_request_shares():
    t = KeyRing.build(["k"]).tenant(b"k")
    assert effective_salt(None, "s", "tenant") == "s"  # no keys: the request's own salt
    assert effective_salt(t, None, "tenant") == t.salt
    assert effective_salt(t, "s", "tenant") == f"{t.salt}/s"
    assert effective_salt(t, "s", "shared") == "s" and effective_salt(t, None, "shared") is None


def test_keys_file_and_flags(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nkey-one\n\nkey-two  # ops\n")
    parser = argparse.ArgumentParser()
    add_auth_arguments(parser.add_argument_group("server"))
    ring = keyring_from_args(parser.parse_args(["--api-key", "k0", "--api-keys-file", str(path)]))
    assert all(ring.tenant(k) is not None for k in (b"k0", b"key-one", b"key-two")) and len(ring.api_keys) == 3
    with pytest.raises(ConfigError, match="api-keys-file"):
        keyring_from_args(parser.parse_args(["--api-keys-file", str(tmp_path / "missing")]))


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"repetition_penalty": 1.0}, {"logit_bias": {}},
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []}, {"best_of": 2, "n": 2},
    {"guided_json": None}, {"store": True, "user": "u", "some_new_openai_field": [1, {"x": 2}]},
    {"presence_penalty": -1.5, "frequency_penalty": 2, "repetition_penalty": 1.3}, {"logit_bias": {"5": -100, "0": 7.5}},
    {"bad_words": ["x"]}, {"best_of": 4}, {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"guided_regex": "a+"}, {"guided_choice": ["a", "b"]}, {"structured_outputs": {"grammar": "root ::= \"a\""}},
])
def test_neutral_unknown_or_implemented_fields_are_accepted(extra):
    for req in (CompletionRequest(prompt="hi", **extra),
                ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)):
        req.check()
        req.sampling_params(4, None)


def test_controls_map_onto_sampling_params():
    req = CompletionRequest(prompt="hi", presence_penalty=0.5, logit_bias={"7": -100}, bad_words=["no"], best_of=3,
                            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                            echo=True, logprobs=2, max_tokens=0)
    req.check()
    p = req.sampling_params(0, req.logprobs, req.num_prompt_logprobs)
    assert (p.presence_penalty, p.logit_bias, p.bad_words, p.best_of) == (0.5, {7: -100.0}, ["no"], 3)
    assert p.structured_outputs.json == {"type": "object"} and p.prompt_logprobs == 2
    assert CompletionRequest(prompt="hi", echo=True, max_tokens=0).num_prompt_logprobs == 0
    assert CompletionRequest(prompt="hi", logprobs=3).num_prompt_logprobs is None  # no echo: no prompt scores
    j = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    assert j.sampling_params(4, None).structured_outputs.json_object is True


@pytest.mark.parametrize(("extra", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": -101}}, "logit_bias"), ({"logit_bias": {"100": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "t"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"), ({"bad_words": [""]}, "bad_words"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"best_of": 0}, "best_of"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 3, "use_beam_search": True, "n": 2}, "best_of"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"seed": -1}, "seed"), ({"seed": 2**64 - 2, "n": 3}, "seed"), ({"stop_token_ids": [100]}, "stop_token_ids"),
])
def test_unsupported_or_out_of_range_values_are_refused_by_name(extra, param):
    """By the body's checks, or (ids outside a vocabulary of 100) by the input processor."""
    req = CompletionRequest(prompt="hi", **extra)
    with pytest.raises(InvalidRequest) as e:
        req.check()
        params = req.sampling_params(4, None, req.num_prompt_logprobs)
        InputProcessor(None, InputLimits(vocab_size=100)).check_params(params)
    assert e.value.param == param


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True}, "echo"),
])
def test_chat_refuses_what_only_completions_implement(extra, param):
    with pytest.raises(InvalidRequest) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra).check()
    assert e.value.param == param


@pytest.mark.parametrize(("extra", "param"), [
    ({"repetition_penalty": True}, "repetition_penalty"), ({"best_of": True}, "best_of"),
    ({"presence_penalty": "0.5"}, "presence_penalty"), ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"bad_words": "x"}, "bad_words"), ({"guided_regex": 3}, "guided_regex"),
    ({"response_format": "json"}, "response_format"), ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
])
def test_wrong_types_of_implemented_fields_are_refused_by_name(extra, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt="hi", **extra)
    assert e.value.errors()[0]["loc"][0] == param


def test_set_controls_names_what_a_relay_would_drop():
    def names(**extra):
        return set_controls(CompletionRequest(prompt="hi", **extra))
    assert names(presence_penalty=0, repetition_penalty=1.0, logit_bias={}, best_of=1,
                 response_format={"type": "text"}, guided_json=None) == []
    assert names(frequency_penalty=0.5, best_of=2, guided_regex="a", prompt_logprobs=0) == [
        "frequency_penalty", "best_of", "guided_regex"]  # the conductor relays prompt_logprobs
