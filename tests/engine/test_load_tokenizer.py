"""`load_tokenizer`, the one tokenizer loader (the engine's `load_model` and the conductor's
gateway): the gateway tokenizes exactly as its instances do, from a GGUF file's metadata, from an
instance's unpacked copy, or from an HF directory without weights."""

from __future__ import annotations

import re
import warnings

import pytest

from kvpool.engine.loader import default_model_path, gguf_cache_dir, load_model, load_tokenizer
from kvpool.errors import ConfigError

TEXT = "The harbour ledger lists 42 crates of tea. <|im_end|> Ünïcödé ✓"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


def _same(a, b) -> None:
    assert a.eos_token_ids == b.eos_token_ids and a.bos_token_id == b.bos_token_id
    assert a.chat_template == b.chat_template
    ids = a.encode(TEXT)
    assert ids == b.encode(TEXT) and a.decode(ids) == b.decode(ids)
    assert a.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        b.apply_chat_template(MESSAGES, add_generation_prompt=True)


def test_a_gguf_files_tokenizer_is_the_engines_from_the_file_and_from_its_unpacked_copy(tmp_path, monkeypatch):
    engine = load_model(None).tokenizer  # leaves the unpacked copy in the default cache
    assert (gguf_cache_dir(default_model_path()) / "done").is_file()
    _same(load_tokenizer(None), engine)  # from the copy
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))  # no copy: the file's metadata
    assert not (gguf_cache_dir(default_model_path()) / "done").exists()
    _same(load_tokenizer(str(default_model_path())), engine)


def test_an_hf_directorys_tokenizer_needs_no_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Fast
    from tokenizers import models, pre_tokenizers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, bos_token_id=1,
                                 eos_token_id=[2, 3]).save_pretrained(tmp_path)  # config only
    fast = Fast(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    fast.pre_tokenizer = pre_tokenizers.Whitespace()
    fast.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}t4 {{ m.content }} {% endfor %}")
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (2, 3)
    assert tok.encode("t5 t9 t63", add_special_tokens=False) == [5, 9, 63]
    assert tok.apply_chat_template([{"role": "user", "content": "t7"}]) == "t4 t7 "


@pytest.mark.parametrize("name", ["missing.gguf", "weights.bin", "no-such-dir"])
def test_a_path_that_is_no_model_is_refused_by_name(tmp_path, name):
    path = tmp_path / name
    if name == "weights.bin":
        path.write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match=re.escape(repr(str(path)))):
        load_tokenizer(path)
    with pytest.raises(ConfigError, match="neither a .gguf file nor an HF directory"):
        load_model(path)
