"""A tiny random Llama directory and PEFT LoRA adapters on it, made here with transformers and
peft (nothing downloaded): shared by the engine's and the server's LoRA tests."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

VOCAB = 128
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def tiny_llama(path: Path) -> Path:
    """Random weights of seed 0 and a word-level vocabulary of VOCAB tokens ("t0" ... )."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def hf_base(path: Path, dtype: torch.dtype = torch.float32):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def make_adapter(base: Path, out: Path, targets: list[str], r: int, alpha: int, rslora: bool = False,
                 seed: int = 0) -> Path:
    """A peft LoRA adapter of `base` with random A and B (B scaled up so that it changes the
    greedy tokens), saved as PEFT writes it (adapter_config.json + adapter_model.safetensors)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_base(base), peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(out)
    return out
