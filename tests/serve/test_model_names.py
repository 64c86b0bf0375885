"""HF directories and model names (#19 item 7): the chat template from `chat_template.jinja` /
`chat_template.json`, `--served-model-name` aliases, the path as an alias, a wrong name's 404,
and `/version` and `/ping`, against a real `kvpool serve` of a tiny random-weight HF directory."""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, AUTH, Server, start_server

import kvpool
from kvpool.engine.tokenizer import Tokenizer
from kvpool.errors import ConfigError
from kvpool.serve import cli

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

VOCAB = 64
TEMPLATE = "{% for m in messages %}t3 {{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"


def _tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer as Fast
    from tokenizers import models, pre_tokenizers

    tok = Fast(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, its template in chat_template.jinja only."""
    import torch

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                                       bos_token_id=1, eos_token_id=2)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer_json(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


# -- templates and names, no server -------------------------------------------------------------
def test_chat_template_is_read_where_transformers_writes_it(tmp_path):
    _tokenizer_json(tmp_path)
    msgs = [{"role": "user", "content": "t9"}]
    assert Tokenizer.from_hf_dir(tmp_path, (2,)).chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    assert Tokenizer.from_hf_dir(tmp_path, (2,)).chat_template == "config"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ messages[0].content }}"}))
    assert Tokenizer.from_hf_dir(tmp_path, (2,)).apply_chat_template(msgs) == "json t9"
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert Tokenizer.from_hf_dir(tmp_path, (2,)).apply_chat_template(msgs) == "t3 t9 t4 t5"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]}))
    assert Tokenizer.from_hf_dir(tmp_path, (2,)).chat_template == "default"
    (tmp_path / "chat_template.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="chat_template.json"):
        Tokenizer.from_hf_dir(tmp_path, (2,))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


class _Loaded:
    def __init__(self, path: Path) -> None:
        self.path, self.name = path, f"{path.stem}-0123456789"


def test_default_id_has_no_hash_and_the_path_and_hashed_id_are_aliases(tmp_path):
    gguf = tmp_path / "Model.Q4_1.gguf"
    args = _args("--model", str(gguf))
    names = cli.served_names(args, _Loaded(gguf))
    assert names == ("Model.Q4_1",)
    assert {str(gguf), "Model.Q4_1-0123456789"} <= cli.model_aliases(args, _Loaded(gguf), names)
    assert cli.served_names(_args(), _Loaded(tmp_path)) == (tmp_path.name,)
    args = _args("--served-model-name", "a", "b", "a")
    assert cli.served_names(args, _Loaded(gguf)) == ("a", "b")
    assert "b" in cli.model_aliases(args, _Loaded(gguf), ("a", "b"))


def test_bad_template_and_tool_flags_fail_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="--chat-template"):
        cli.main(_args("--chat-template", str(tmp_path / "missing.jinja")))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="line 1"):
        cli.main(_args("--chat-template", str(bad)))
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        cli.main(_args("--enable-auto-tool-choice"))
    with pytest.raises(SystemExit):
        _args("--tool-call-parser", "nonsense")


# -- a real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server(hf_dir) -> Iterator[Server]:
    s = start_server("--model", str(hf_dir), "--served-model-name", "tiny", "tiny-alias", "--api-key", API_KEY,
                     headers=AUTH)
    yield s
    assert s.stop() == 0, s.log.read_text()


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY, max_retries=0)


def test_served_names_are_listed_first_first_and_each_is_accepted(client, hf_dir):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias", str(hf_dir)):
        r = client.completions.create(model=name, prompt="t5 t6", max_tokens=2, temperature=0)
        assert r.model == "tiny" and r.choices[0].text is not None
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="t5", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_chat_uses_the_template_from_chat_template_jinja(client, tiny_server):
    r = httpx.post(f"{tiny_server.url}/tokenize", headers=AUTH, json={"messages": [{"role": "user", "content": "t7 t8"}]})
    assert r.json()["tokens"] == [3, 7, 8, 4, 5]
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t7"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_version_needs_the_key_and_ping_is_open_like_health(tiny_server):
    assert httpx.get(f"{tiny_server.url}/version").status_code == 401
    r = httpx.get(f"{tiny_server.url}/version", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"version": kvpool.__version__}
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{tiny_server.url}/ping").status_code == 200
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
