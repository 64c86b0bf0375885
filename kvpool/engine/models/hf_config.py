"""HF `config.json` -> ModelConfig, refusing what the model code does not compute.

Every key of the config is either read (and its value checked), known to leave inference
unchanged, or refused with a ConfigError naming it: a checkpoint setting we do not implement
would otherwise load and give wrong tokens without an error. Metadata is recognised by name
(the keys transformers, PEFT and conversion tools write), by shape (a leading underscore, a
`*_token_id`) or by a value that selects what we compute anyway (`rope_interleaved: false`), and
logged once at debug level. Both config generations are
read: `rope_theta` / `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvpool.engine.models.config import ACTIVATIONS, ModelConfig
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)

def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Keys that never change what a forward pass in eval mode computes.
_INERT = _words(
    "architectures model_type transformers_version torch_dtype dtype _name_or_path "
    "name_or_path output_hidden_states output_attentions return_dict use_return_dict "
    "use_cache torchscript chunk_size_feed_forward is_encoder_decoder is_decoder problem_type "
    "id2label label2id initializer_range pad_token_id sep_token_id decoder_start_token_id "
    "attention_dropout resid_pdrop embd_pdrop hidden_dropout hidden_dropout_prob "
    "attention_probs_dropout_prob tokenizer_class pruned_heads tie_encoder_decoder "
    "add_cross_attention cross_attention_hidden_size task_specific_params finetuning_task "
    "prefix tf_legacy_loss use_bfloat16 max_length min_length do_sample early_stopping "
    "num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p "
    "repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size "
    "bad_words_ids num_return_sequences output_scores return_dict_in_generate "
    "forced_bos_token_id forced_eos_token_id remove_invalid_values "
    "exponential_decay_length_penalty suppress_tokens begin_suppress_tokens "
    "_attn_implementation_autoset _attn_implementation attn_implementation pretraining_tp "
    "cache_implementation auto_map keys_to_ignore_at_inference "
    # informational keys of conversion and fine-tuning tools (nanotron, transformers.js, Unsloth)
    "is_llama_config transformers.js_config unsloth_version unsloth_fixed model_name "
    "base_model_name_or_path tokenizer_name"
)
# Keys that would change the computation at other values: accepted at the one we compute.
_NEUTRAL = {"rope_interleaved": False, "use_mrope": False}
_logged_inert: set[str] = set()
_ROPE_KEYS = _words(
    "rope_type type rope_theta factor low_freq_factor high_freq_factor "
    "original_max_position_embeddings partial_rotary_factor"
)
_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, slots=True)
class Arch:
    """What one model_type adds to Llama, and the config keys that carry it."""

    keys: frozenset[str]  # architecture-specific keys this parser reads
    qkv_bias: str | None = "attention_bias"  # key for q/k/v biases; "always" (Qwen2) or None
    o_bias: bool = True  # o_proj follows attention_bias (not for Qwen2)
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) sandwich norms, sqrt(hidden) embedding scale, query_pre_attn_scalar
    act_key: str = "hidden_act"
    windows: str = "none"  # none | all (one window, every layer) | qwen | layer_types
    default_pattern: int = 0  # Gemma: every n-th layer is full attention when layer_types is absent


_COMMON = _words("head_dim rope_theta rope_scaling rope_parameters")
ARCHS: dict[str, Arch] = {
    "llama": Arch(_COMMON | {"attention_bias", "mlp_bias"}),
    "mistral": Arch(_COMMON | {"sliding_window"}, qkv_bias=None, o_bias=False, windows="all"),
    "qwen2": Arch(
        _COMMON | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
        qkv_bias="always", o_bias=False, windows="qwen",
    ),
    "qwen3": Arch(
        _COMMON | {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
                   "layer_types"},
        qk_norm=True, windows="qwen",
    ),
    "gemma2": Arch(
        _COMMON | {"attention_bias", "sliding_window", "layer_types", "query_pre_attn_scalar",
                   "attn_logit_softcapping", "final_logit_softcapping", "hidden_act",
                   "use_bidirectional_attention"},
        gemma=True, act_key="hidden_activation", windows="layer_types", default_pattern=2,
    ),
    "gemma3_text": Arch(
        _COMMON | {"attention_bias", "sliding_window", "layer_types", "query_pre_attn_scalar",
                   "attn_logit_softcapping", "final_logit_softcapping", "hidden_act",
                   "use_bidirectional_attention", "rope_local_base_freq", "sliding_window_pattern",
                   "_sliding_window_pattern"},
        qk_norm=True, gemma=True, act_key="hidden_activation", windows="layer_types",
        default_pattern=6,
    ),
    "phi3": Arch(
        _COMMON | {"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"},
        qkv_bias=None, o_bias=False, windows="all",
    ),
}
_SHAPE_KEYS = _words(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads rms_norm_eps max_position_embeddings tie_word_embeddings "
    "bos_token_id eos_token_id hidden_act hidden_activation"
)


def hf_config_to_model_config(cfg: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF config.json (and generation_config.json), or ConfigError naming
    the first key or value the model code does not implement."""
    model_type = cfg.get("model_type", "llama")
    arch = ARCHS.get(model_type)
    if arch is None:
        raise ConfigError(f"model_type {model_type!r} unsupported; expected one of {sorted(ARCHS)}")
    inert = []
    for key, value in cfg.items():
        if key in _SHAPE_KEYS or key in arch.keys:
            continue
        if not _is_metadata(key, value):
            raise ConfigError(
                f"config field {key}={value!r} is not implemented for model_type {model_type!r}"
            )
        inert.append(key)
    if new := sorted(set(inert) - _logged_inert):
        _logged_inert.update(new)
        logger.debug("config fields read as metadata (no effect on the computation): %s", ", ".join(new))
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    act = cfg.get(arch.act_key) or ("gelu_pytorch_tanh" if arch.gemma else "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"config field {arch.act_key}={act!r} unsupported; use one of {ACTIVATIONS}")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("config field use_bidirectional_attention=True unsupported (decoders only)")
    bias = bool(cfg.get("attention_bias", False))
    windows = _layer_windows(cfg, arch, layers)
    global_rope, local_rope = _rope(cfg, arch, windows)
    rotary = global_rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = None if float(rotary) == 1.0 else int(head_dim * float(rotary))
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    qpas = cfg.get("query_pre_attn_scalar") if arch.gemma else None
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.gemma)),
        qkv_bias=arch.qkv_bias == "always" or (arch.qkv_bias is not None and bias),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=model_type,
        hidden_act=act,
        o_bias=arch.o_bias and bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch.qk_norm,
        norm_offset=arch.gemma,
        sandwich_norms=arch.gemma,
        embed_scale=hidden**0.5 if arch.gemma else None,
        attn_scale=None if qpas is None else float(qpas) ** -0.5,
        attn_softcap=_cap(cfg, "attn_logit_softcapping"),
        final_softcap=_cap(cfg, "final_logit_softcapping"),
        rotary_dim=rotary_dim,
        layer_windows=windows if any(w is not None for w in windows) else (),
        local_rope_theta=local_rope,
        **global_rope,
    )


def _is_metadata(key: str, value: Any) -> bool:
    """Whether a config key leaves the forward pass unchanged: a known informational key, a
    private one (`_name_or_path`, `_model_name_or_path`), a special token's id (`unk_token_id`:
    the tokenizer owns them; bos/eos are read), or a switch at the value we compute."""
    if key in _NEUTRAL:
        return value == _NEUTRAL[key]
    return key in _INERT or key.startswith("_") or key.endswith(("_token_id", "_token_ids"))


def _cap(cfg: dict[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is not None and float(value) <= 0:
        raise ConfigError(f"config field {key}={value!r} must be positive or null")
    return None if value is None else float(value)


def _layer_windows(cfg: dict[str, Any], arch: Arch, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers derives it."""
    window = cfg.get("sliding_window")
    if arch.windows == "qwen" and not cfg.get("use_sliding_window", False):
        window = None
    if arch.windows == "none":
        return (None,) * layers
    if arch.windows == "all":
        return (None if window is None else int(window),) * layers
    types = cfg.get("layer_types")
    if types is None and arch.windows == "qwen":
        start = int(cfg.get("max_window_layers", layers))
        types = [_SLIDING if window is not None and i >= start else _FULL for i in range(layers)]
    elif types is None:
        every = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", arch.default_pattern)))
        types = [_SLIDING if (i + 1) % every else _FULL for i in range(layers)]
    if len(types) != layers or any(t not in (_SLIDING, _FULL) for t in types):
        raise ConfigError(
            f"config field layer_types={types!r} unsupported: need {layers} entries of "
            f"{_SLIDING!r} or {_FULL!r}"
        )
    if _SLIDING in types and window is None:
        raise ConfigError("config field layer_types has sliding layers but sliding_window is null")
    return tuple(int(window) if t == _SLIDING else None for t in types)


def _rope(
    cfg: dict[str, Any], arch: Arch, windows: tuple[int | None, ...]
) -> tuple[dict[str, Any], float | None]:
    """(ModelConfig rope fields of the full-attention layers, Gemma-3's local rope base)."""
    params = cfg.get("rope_parameters") or {}
    local: dict[str, Any] | None = None
    if _FULL in params or _SLIDING in params:  # transformers 5, per layer type (Gemma-3)
        local, params = params.get(_SLIDING), params.get(_FULL) or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"config field rope_scaling.rope_type={kind!r} unsupported; use default, linear or llama3"
        )
    for key in merged:
        if key not in _ROPE_KEYS:
            raise ConfigError(f"config field rope_scaling.{key}={merged[key]!r} is not implemented")
    out: dict[str, Any] = {
        "rope_theta": float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "rope_scaling_type": kind,
    }
    if kind != "default":
        out["rope_scaling_factor"] = float(merged["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(merged.get("low_freq_factor", 1.0))
        out["rope_high_freq_factor"] = float(merged.get("high_freq_factor", 4.0))
        out["rope_original_max_position"] = int(merged.get("original_max_position_embeddings", 8192))
    if "partial_rotary_factor" in merged:
        out["partial_rotary_factor"] = merged["partial_rotary_factor"]
    if not arch.gemma or "rope_local_base_freq" not in arch.keys:
        return out, None
    local = local or {}
    for key, value in local.items():
        if key not in ("rope_type", "rope_theta") or (key == "rope_type" and value != "default"):
            raise ConfigError(f"config field rope_parameters.sliding_attention.{key}={value!r} unsupported")
    theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return out, float(theta) if any(w is not None for w in windows) else None
