"""GGUF metadata -> ModelConfig, refusing keys and values the model code does not implement.

Every `{arch}.*` key is read or refused by name; `general.*` keys describe the file, and the
tokenizer reads `tokenizer.*` (refusing what it cannot build). Gemma-3 files leave some of the
model implicit, as llama.cpp does: every sixth layer is global, local layers use rope base 10000,
and queries are scaled by key_length ** -0.5 (hidden / heads for the 62-layer 27B).
"""

from __future__ import annotations

from typing import Any

from kvpool.engine.models.config import ModelConfig
from kvpool.errors import ConfigError

_COMMON = frozenset(
    (  # noqa: SIM905 (a list literal would be 15 lines)
        "context_length embedding_length block_count feed_forward_length vocab_size "
        "attention.head_count attention.head_count_kv attention.layer_norm_rms_epsilon "
        "attention.key_length attention.value_length rope.freq_base rope.dimension_count "
        "rope.scaling.type rope.scaling.factor rope.scaling.original_context_length"
    ).split()
)
GGUF_ARCHS: dict[str, frozenset[str]] = {
    "llama": _COMMON,
    "qwen2": _COMMON,
    "gemma3": _COMMON | {"attention.sliding_window", "final_logit_softcapping", "attn_logit_softcapping"},
}
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gguf_model_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"GGUF general.architecture={arch!r} unsupported; expected one of {sorted(GGUF_ARCHS)}")
    known = GGUF_ARCHS[arch]
    for key in meta:
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") not in known:
            raise ConfigError(f"GGUF metadata {key}={meta[key]!r} is not implemented for {arch!r}")
        if not key.startswith((f"{arch}.", "general.", "tokenizer.")):
            raise ConfigError(f"GGUF metadata {key}={meta[key]!r} is not implemented")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"GGUF {arch}.attention.value_length != key_length={head_dim} unsupported")
    rotary = int(get("rope.dimension_count", head_dim))
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(f"GGUF {arch}.rope.scaling.type={scaling!r} unsupported; use none or linear")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    gemma = arch == "gemma3"
    window = get("attention.sliding_window")
    windows: tuple[int | None, ...] = ()
    if gemma and window is not None:
        windows = tuple(None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else int(window) for i in range(layers))
    qpas = (hidden // heads if layers == 62 else head_dim) if gemma else None
    caps = {key: get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        vocab_size=int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        rope_scaling_type="linear" if scaling == "linear" else "default",
        rope_scaling_factor=float(get("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0,
        architecture="gemma3_text" if gemma else arch,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        norm_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=hidden**0.5 if gemma else None,
        attn_scale=None if qpas is None else qpas**-0.5,
        attn_softcap=None if caps["attn_logit_softcapping"] is None else float(caps["attn_logit_softcapping"]),
        final_softcap=None if caps["final_logit_softcapping"] is None else float(caps["final_logit_softcapping"]),
        rotary_dim=None if rotary == head_dim else rotary,
        layer_windows=windows,
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA if windows else None,
    )
