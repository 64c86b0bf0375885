"""One decoder for the Llama family and its relatives over a paged KV cache.

embedding → layers (norm, attention, norm, MLP; each norm takes the residual add) → norm → head.
Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma-2/3 and Phi-3 differ in a handful of named
features (`ModelConfig`: q/k norms, Gemma's (1 + w) and sandwich norms, embedding scale,
soft-capping, per-layer sliding windows and rope bases, partial rotary, biases, activation);
the layers below switch on them. Speed lives in the building blocks (`engine/layers`): linear
layers chosen at load time, norms and activations fused where the rows allow, and the native
decode loop that runs the whole stack for a decode-sized step. The model sees flat token
batches only: ids, positions, per-layer KV caches and the attention metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kvpool.engine.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kvpool.engine.layers import fused_ops, packing
from kvpool.engine.layers.activation import GatedActivation
from kvpool.engine.layers.decode_loop import DecodeLoop
from kvpool.engine.layers.linear import CheckpointLinear, pad_rows, row_bucket
from kvpool.engine.layers.norm import RMSNorm
from kvpool.engine.layers.rotary import Rotary, apply_rotary
from kvpool.engine.models.config import ModelConfig, rope_inv_freq
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.engine.lora.adapters import AdapterSet, LayerLora


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[KVCache]:
    """Per layer a (k, v) pair shaped [num_blocks, block_size, num_kv_heads, head_dim]."""
    if num_blocks < 1 or block_size < 1:
        raise ConfigError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]


def num_blocks_for_budget(
    config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many KV blocks of `block_size` tokens fit in `budget_bytes`."""
    per_block = config.kv_bytes_per_token(dtype) * block_size
    n = budget_bytes // per_block
    if n < 1:
        raise ConfigError(
            f"KV budget {budget_bytes} bytes holds no block; one block needs {per_block} bytes"
        )
    return int(n)


class LlamaAttention(nn.Module):
    """Fused QKV projection; optional per-head q/k norms; rope on Q and K together; KV written
    to slots, then paged attention (windowed and soft-capped where the layer is)."""

    lora: LayerLora | None = None  # LoRA adapters' hooks (kvpool.engine.lora), when enabled
    PROJECTIONS = ("qkv_proj", "o_proj")

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = CheckpointLinear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o_proj = CheckpointLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        self.scale = config.attn_scale or config.head_dim**-0.5
        self.window = config.window(layer)
        self.softcap = config.attn_softcap

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        t = meta.num_tokens  # x may carry padding rows past them (see LlamaForCausal.forward)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            qkv = self.lora.add("qkv_proj", x, qkv)
        if qkv.shape[0] != t:
            qkv = qkv[:t]
        k_cache, v_cache = kv_cache
        if self._fused_rope(qkv, cos, k_cache):
            q, k = fused_ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h, hkv)
            # only prefill chunks read the step's own K/V (decode rows read the cache)
            new_kv = (k, qkv[:, (h + hkv) * d :].view(t, hkv, d)) if meta.prefills else None
        else:
            v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
            qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
            if self.qk_norm:
                qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            new_kv = (k, v)
        out = paged_attention(
            q, k_cache, v_cache, meta, self.scale, new_kv=new_kv,
            window=self.window, softcap=self.softcap,
        ).reshape(t, h * d)
        out = pad_rows(out, x.shape[0])
        return self.o_proj(out) if self.lora is None else self.lora.add("o_proj", out, self.o_proj(out))

    def _fused_rope(self, qkv: Tensor, cos: Tensor, k_cache: Tensor) -> bool:
        """RoPE + K/V write as one op: full rotary, no q/k norms, a cache of the rows' dtype."""
        return (
            not self.qk_norm
            and 2 * cos.shape[-1] == self.head_dim
            and cos.dtype == k_cache.dtype == qkv.dtype
            and k_cache.is_contiguous()
            and fused_ops.usable(qkv)
        )


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate) * up), gate and up in one projection."""

    lora: LayerLora | None = None  # LoRA adapters' hooks (kvpool.engine.lora), when enabled
    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = CheckpointLinear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = CheckpointLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = GatedActivation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora.add("gate_up_proj", x, gate_up)
        h = self.act(gate_up)
        return self.down_proj(h) if self.lora is None else self.lora.add("down_proj", h, self.down_proj(h))


class LlamaLayer(nn.Module):
    """Pre-norm residual block; with sandwich norms (Gemma-2/3) the attention and MLP outputs
    are normed too before they join the residual stream. The residual add is carried into the
    next norm: a layer takes (the previous layer's output, the residual stream before it; None
    in the first layer, where x is the stream) and returns the same pair."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, off, h = config.rms_norm_eps, config.norm_offset, config.hidden_size
        self.input_layernorm = RMSNorm(h, eps, off)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.mlp = LlamaMLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)
        self.local_rope = config.window(layer) is not None and config.local_rope_theta is not None

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaForCausal(nn.Module):
    """The decoder; `forward` returns final-normed hidden states, `compute_logits` projects.
    Its weights are uninitialized until `load_weights` (norms start at ones)."""

    lora: AdapterSet | None = None  # the LoRA adapters it serves (kvpool.engine.lora), when enabled

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary = Rotary(config)
        self.local_rotary = Rotary(config, local=True) if config.local_rope_theta else None
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.head: nn.Module | None = None  # the LM head's linear layer, once `pack_cpu_weights` chose it
        self.q4_rows = 0  # batches up to this many rows run on 4-bit weights
        self.pads_rows = False  # larger ones are padded to a row bucket: a projection's kernel wants it
        self.decode_loop: DecodeLoop | None = None  # decode-sized steps' native layer loop, once packed
        self.before_layer: Callable[[int], None] | None = None  # layer-wise KV load: wait for layer i's KV
        # Quantized groups from the loader (module name -> groups): a GGUF file's exact ones,
        # or an HF checkpoint's quantized on request; none are recovered here
        self.quant_groups: dict[str, tuple[Tensor, ...]] = {}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> Tensor:
        num_tokens = input_ids.shape[0]
        if self.pads_rows and num_tokens > self.q4_rows:
            # Pad once to the packed kernels' row bucket so the MLP and QKV projections take
            # their input as is (attention runs on the real rows only, o_proj pads its own).
            # 4-bit and AMX tile kernels take any row count: padding would only add work.
            input_ids = pad_rows(input_ids, row_bucket(num_tokens))
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = self.rotary(positions, x.dtype)
        local = self.local_rotary(positions, x.dtype) if self.local_rotary is not None else rope
        loop = self.decode_loop
        if self.lora is not None and self.lora.groups is not None:
            loop = None  # the native loop cannot add adapter deltas: this step's rows take the layers
        if loop is not None and num_tokens <= self.q4_rows and self.before_layer is None and loop.takes(x, kv_caches, meta):
            return loop(x, rope, local, kv_caches, meta)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if self.before_layer is not None:
                self.before_layer(i)
            x, residual = layer(x, residual, *(local if layer.local_rope else rope), kv_cache, meta.for_layer(i))
        if residual is None:  # no layers
            return self.norm(x[:num_tokens])
        return self.norm(x[:num_tokens], residual[:num_tokens])[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.head is not None:
            logits = self.head(hidden.contiguous()).float()
        else:
            logits = F.linear(hidden, self.head_weight()).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def head_weight(self) -> Tensor:
        """The LM head's weight: its own, or the embedding table where they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def pack_cpu_weights(self, q4_kernels: bool = False) -> None:
        """Choose each projection's (and the LM head's) linear layer now that the weights are
        loaded (`layers/packing.py`), then the native decode loop where every layer takes it."""
        if self.head is not None:
            return
        packer = packing.LinearPacker(self.embed_tokens.weight.dtype, q4_kernels, self.quant_groups)
        for i, layer in enumerate(tqdm(self.layers, desc="packing weights", unit="layer", leave=False, disable=None)):
            for part, owner in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
                for proj in owner.PROJECTIONS:
                    lin = getattr(owner, proj)
                    setattr(owner, proj, packer.linear(f"layers.{i}.{part}.{proj}", lin.weight, lin.bias))
        self.head = packer.head("embed_tokens.weight" if self.lm_head is None else "lm_head", self.head_weight())
        self.quant_groups = {}
        self.q4_rows = packer.q4_rows
        self.pads_rows = any(getattr(getattr(owner, proj), "row_buckets", False)
                             for layer in self.layers for owner in (layer.self_attn, layer.mlp)
                             for proj in owner.PROJECTIONS)
        self.decode_loop = DecodeLoop.build(self.config, self.layers, self.norm)
        packer.report(4 * len(self.layers), self.head, self.decode_loop is not None)

    def warm_up_packed(self, max_tokens: int, max_logit_rows: int) -> None:
        """Pre-build the packed layers' CPU kernels for the sizes early steps produce."""
        c = self.config
        layer_weights = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
        layer = self.layers[0]
        lins = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if self.head is not None:
            packing.warm_up(lins, self.head, layer_weights, max_tokens, max_logit_rows)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing QKV and
        gate/up (Phi-3 ships them fused already). Raises ConfigError naming any tensor missing
        or unexpected."""
        pending: dict[str, Tensor] = {}
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: Tensor) -> None:
            if name not in params:
                raise ConfigError(f"checkpoint tensor {name!r} has no place in the model")
            p = params[name]
            if tuple(p.shape) != tuple(value.shape):
                raise ConfigError(
                    f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(value)
            loaded.add(name)

        for name, value in weights:
            name = name.removeprefix("model.")
            if name == "rope_freqs.weight":
                self.rotary.set_inv_freq(rope_inv_freq(self.config) / value.to(torch.float64))
            elif name == "lm_head.weight":
                if not self.config.tie_word_embeddings:
                    put("lm_head", value)
            elif "rotary_emb" in name:
                continue
            else:
                pending[name] = value
        for i in range(self.config.num_layers):
            pre = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [pending.pop(f"{pre}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
                if all(t is not None for t in parts):
                    put(f"{pre}self_attn.qkv_proj.{kind}", torch.cat(parts, dim=0))
                gate, up = (
                    pending.pop(f"{pre}mlp.gate_proj.{kind}", None),
                    pending.pop(f"{pre}mlp.up_proj.{kind}", None),
                )
                if gate is not None and up is not None:
                    put(f"{pre}mlp.gate_up_proj.{kind}", torch.cat([gate, up], dim=0))
        for name, value in pending.items():
            put(name, value)
        missing = set(params) - loaded
        if missing:
            raise ConfigError(
                f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
