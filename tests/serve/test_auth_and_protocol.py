"""Pure pieces: keys and tenant salts, and the protocol's refusals, without a server."""

from __future__ import annotations

import argparse

import pytest

from kvpool.errors import ConfigError, InvalidRequest
from kvpool.serve.auth import KeyRing, add_auth_arguments, effective_salt, keyring_from_args
from kvpool.serve.protocol import ChatCompletionRequest, CompletionRequest


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
])
def test_neutral_or_unknown_fields_are_accepted(extra):
    CompletionRequest(prompt="hi", **extra).check(100)
    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra).check(100)


@pytest.mark.parametrize(("extra", "param"), [
    ({"presence_penalty": 0.1}, "presence_penalty"), ({"repetition_penalty": True}, "repetition_penalty"),
    ({"logit_bias": {"5": -100}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"best_of": 4}, "best_of"), ({"best_of": True}, "best_of"),
    ({"guided_regex": "a+"}, "guided_regex"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"seed": -1}, "seed"), ({"seed": 2**64 - 2, "n": 3}, "seed"), ({"stop_token_ids": [100]}, "stop_token_ids"),
])
def test_unsupported_or_out_of_range_values_are_refused_by_name(extra, param):
    with pytest.raises(InvalidRequest) as e:
        CompletionRequest(prompt="hi", **extra).check(100)
    assert e.value.param == param
