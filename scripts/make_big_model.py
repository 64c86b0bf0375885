"""Write a SmolLM2-1.7B-shaped Llama as an HF directory (random bf16 weights, the bundled model's
tokenizer) for load-time, memory and speed measurements at a realistic size, not for quality.

    .venv/bin/python scripts/make_big_model.py OUT [--shard 2GB] [--layers 24] [--shape 135m]
        [--tokenizer DIR]

`--shape 135m` writes the bundled model's own shape instead (on a machine without the bundled
GGUF, e.g. a GPU machine); `--tokenizer DIR` copies tokenizer.json and tokenizer_config.json
from DIR (written by an earlier run) instead of reading them from the bundled GGUF.

The shape is SmolLM2-1.7B's: 24 layers, hidden 2048, 32 heads (MHA), FFN 8192, 49,152 tokens,
tied embeddings, rope base 130000, 8k context. transformers builds it and `save_pretrained`
writes it (~3.4 GB), so its config.json holds what transformers writes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def write_tokenizer(out: Path) -> tuple[int | None, int]:
    """The bundled GGUF's tokenizer and chat template, as an HF directory keeps them; returns
    (bos, eos) ids. Only the file's metadata is read."""
    from kvpool.engine.loader import default_model_path
    from kvpool.engine.models.gguf_file import GGUFFile
    from kvpool.engine.tokenizer import Tokenizer

    meta = GGUFFile(default_model_path()).fields
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    tok = Tokenizer.from_gguf_metadata(meta, (eos,))
    tok.fast.save(str(out / "tokenizer.json"))
    name = tok.fast.id_to_token
    config = {"chat_template": tok.chat_template, "eos_token": name(eos),
              "bos_token": None if tok.bos_token_id is None else name(tok.bos_token_id)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.bos_token_id, eos


SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, rope_theta=130000.0),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0),
}


def copy_tokenizer(src: Path, out: Path) -> tuple[int | None, int]:
    """The tokenizer files an earlier run wrote; (bos, eos) ids from their token names."""
    import shutil

    from tokenizers import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    vocab = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = None if config.get("bos_token") is None else vocab.token_to_id(config["bos_token"])
    return bos, vocab.token_to_id(config["eos_token"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shard", default=None, help="max shard size for save_pretrained (e.g. 2GB); default one file")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--tokenizer", type=Path, default=None, help="copy the tokenizer files from this directory")
    args = ap.parse_args()
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    bos, eos = copy_tokenizer(args.tokenizer, args.out) if args.tokenizer else write_tokenizer(args.out)
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = LlamaConfig(
        vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, initializer_range=0.02, **shape,
    )
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of a float32 build
    model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(args.out, **({"max_shard_size": args.shard} if args.shard else {}))
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(args.out)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e9:.2f}B params, {size / 1e9:.2f} GB of safetensors, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
