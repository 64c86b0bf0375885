"""The gateway's tokenizer: read from the model files without loading any weights."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer

from kvpool.engine.loader import (
    default_model_path,
    gguf_cache_dir,
    gguf_fields,
    hf_config_to_model_config,
)
from kvpool.engine.tokenizer import Tokenizer
from kvpool.errors import ConfigError


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer the instances use for `model` (None = the bundled SmolLM2)."""
    path = default_model_path() if model is None else Path(model)
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return Tokenizer.from_hf_dir(path, hf_config_to_model_config(cfg, gen).eos_token_ids)
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"model path {str(path)!r} is neither a .gguf file nor an HF directory")
    cache = gguf_cache_dir(path)
    if (cache / "done").is_file():  # an instance already unpacked it
        meta = json.loads((cache / "model.json").read_text())
        return Tokenizer(FastTokenizer.from_file(str(cache / "tokenizer.json")),
                         tuple(meta["config"]["eos_token_ids"]), meta["bos_token_id"], meta["chat_template"])
    import gguf

    fields = gguf_fields(gguf.GGUFReader(str(path)))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return Tokenizer.from_gguf_metadata(fields, () if eos is None else (int(eos),))
