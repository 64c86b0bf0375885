"""One decoder for the Llama family and its relatives over a paged KV cache.

Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma-2/3 and Phi-3 differ in a handful of named
features (`ModelConfig`: q/k norms, Gemma's (1 + w) and sandwich norms, embedding scale,
soft-capping, per-layer sliding windows and rope bases, partial rotary, biases, activation);
the layers below switch on them. The model sees flat token batches only: ids, positions,
per-layer KV caches and the attention metadata. Sequences, sharing and scheduling live above it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kvpool.engine.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kvpool.engine.kernels import batch_invariant, decode_loop_available, q4_linear_available
from kvpool.engine.models import fused
from kvpool.engine.models.config import ModelConfig, rope_inv_freq
from kvpool.engine.models.quantized import Q4Linear, Q8Linear, lanes_groups, row_limits
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.engine.lora.adapters import AdapterSet, LayerLora

logger = logging.getLogger(__name__)


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


class Rotary(nn.Module):
    """Cos/sin tables indexed by position, HF's rotate_half convention (halves, not pairs)."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.set_inv_freq(rope_inv_freq(config, local))

    def set_inv_freq(self, inv_freq: Tensor) -> None:
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq.to(torch.float64))
        device = self.cos.device
        self.cos = angles.cos().to(torch.float32).to(device)
        self.sin = angles.sin().to(torch.float32).to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """[T, 1, R/2] cos and sin for the given positions (R: the rotated dims)."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; rotates the first/second halves of the first R dims as HF's
    rotate_half does; dims past R (partial rotary) pass through."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (w * normed, cast first); with `offset`, Gemma's ((1 + w) * normed in
    float32, cast last). Both are one fused op in float32."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if self.offset:
            scale = 1.0 + self.weight.float()
            return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if x.dim() == 2 and fused.usable(x):
            return fused.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class CheckpointLinear(nn.Linear):
    """An nn.Linear allocated but not initialized: `load_weights` fills every parameter (and
    refuses a checkpoint that misses one). Random init under the meta device runs torch's
    Python decompositions, whose first use imports ~3 s of modules into every process."""

    def reset_parameters(self) -> None:
        pass


class LlamaAttention(nn.Module):
    """Fused QKV projection; optional per-head q/k norms; rope on Q and K together; KV written
    to slots, then paged attention (windowed and soft-capped where the layer is)."""

    lora: LayerLora | None = None  # LoRA adapters' hooks (kvpool.engine.lora), when enabled

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
            q, k = fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h, hkv)
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
            and fused.usable(qkv)
        )


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate) * up), gate and up in one projection."""

    lora: LayerLora | None = None  # LoRA adapters' hooks (kvpool.engine.lora), when enabled

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_up_proj = CheckpointLinear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = CheckpointLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora.add("gate_up_proj", x, gate_up)
        if self.act is F.silu and fused.usable(gate_up):
            h = fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h) if self.lora is None else self.lora.add("down_proj", h, self.down_proj(h))


class LlamaLayer(nn.Module):
    """Pre-norm residual block; with sandwich norms (Gemma-2/3) the attention and MLP outputs
    are normed too before they join the residual stream."""

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
        # Llama-style norms and SiLU: the layer can run on the fused ops (`fused_forward`)
        self.fusable = not self.sandwich and not off and config.hidden_act == "silu"

    def fused_forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """`forward` through the fused ops (bf16 or float32 rows), the residual add carried into
        the next norm: takes (the previous layer's MLP output, the residual stream before it;
        None in the first layer, where x is the stream) and returns the same pair. In bf16 it
        equals `forward` bit for bit (both round the sum to bf16 before normalizing it)."""
        norm = self.input_layernorm
        if residual is None:
            h, residual = fused.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
        attn = self.self_attn(h, cos, sin, kv_cache, meta)
        norm = self.post_attention_layernorm
        h, residual = fused.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return self.mlp(h), residual  # fusable: SiLU, so the MLP runs fused.silu_mul

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        if not self.sandwich:
            attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
            norm = self.post_attention_layernorm
            if not norm.offset and fused.usable(x):  # the residual add and the norm in one op
                h, x = fused.add_rms_norm(attn, x, norm.weight, norm.eps)
                return x + self.mlp(h)
            x = x + attn
            return x + self.mlp(norm(x))
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` (itself when it has them)."""
    extra = rows - x.shape[0]
    return x if extra <= 0 else torch.cat((x, x.new_zeros(extra, *x.shape[1:])))


def row_bucket(rows: int) -> int:
    """Rows padded to one of few sizes: oneDNN builds a kernel per new shape (~0.7 ms per
    projection), which would tax every step whose token count is new. Small batches round up
    to a multiple of 8 (nearly free: weight-bandwidth bound), larger ones by at most 1/8 (49
    shapes up to 2304 rows)."""
    step = max(8, 1 << max(0, (rows - 1).bit_length() - 4))
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """A frozen Linear whose weight is pre-packed for oneDNN's CPU GEMM: the blocked layout
    streams weights 1.2-3x faster than `F.linear`, most at decode batch sizes (vLLM's CPU
    backend does the same). Results match `F.linear` to float rounding."""

    def __init__(self, weight: Tensor, bias: Tensor | None, batch_hint: int = 8) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach()
        self.in_features = weight.shape[1]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        x = pad_rows(x, row_bucket(rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]

    def warm_up(self, max_rows: int) -> None:
        """Build the kernel of every row bucket up to `max_rows` now, not in a served step."""
        rows = 1
        while rows <= max_rows:
            bucket = row_bucket(rows)
            self(torch.zeros(bucket, self.in_features, dtype=self.packed.dtype))
            rows = bucket + 1


# Row buckets worth building before the first step: a kernel's build costs ~1.5-2 ms whatever
# the rows (measured, one thread), most of an 8-row projection's time but under a tenth of a
# 256-row one's, so larger buckets build on first use. Building all 49 took 7 s a process.
WARM_UP_ROWS = 256
WARM_UP_LAYER_WEIGHTS = 3_538_944  # ... for a layer of this many weights (SmolLM2-135M's)


class FrozenLinear(nn.Module):
    """`F.linear` on a frozen weight: the dense copy where oneDNN cannot pack the dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def can_pack_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bf16 ones only where it has a bf16 GEMM
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere a bf16 model keeps `F.linear`."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


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
        self._packed_head: PackedLinear | Q8Linear | None = None
        self.q4_rows = 0  # batches up to this many rows run on 4-bit weights
        self.before_layer: Callable[[int], None] | None = None  # layer-wise KV load: wait for layer i's KV
        # Quantized groups from the loader (module name -> groups): a GGUF file's exact ones,
        # or an HF checkpoint's quantized on request; none are recovered here
        self.quant_groups: dict[str, tuple[Tensor, ...]] = {}
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self._fusable = all(layer.fusable for layer in self.layers)
        self._loop: fused.DecodeLoop | None = None  # decode-sized steps' native layer loop, once packed

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> Tensor:
        num_tokens = input_ids.shape[0]
        if self._packed_head is not None and num_tokens > self.q4_rows:
            # Pad once to the packed kernels' row bucket so the MLP and QKV projections take
            # their input as is (attention runs on the real rows only, o_proj pads its own).
            # 4-bit kernels take any row count: padding would only add work.
            input_ids = pad_rows(input_ids, row_bucket(num_tokens))
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        rope = self.rotary(positions, x.dtype)
        local = self.local_rotary(positions, x.dtype) if self.local_rotary is not None else rope
        loop = self._loop
        if self.lora is not None and self.lora.groups is not None:
            loop = None  # the native loop cannot add adapter deltas: this step's rows take the layers
        if loop is not None and num_tokens <= self.q4_rows and self.before_layer is None and loop.takes(x, kv_caches, meta):
            return loop(x, rope, local, kv_caches, meta)
        if self._fusable and fused.usable(x):
            return self._fused_layers(x, rope, local, kv_caches, meta, num_tokens)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if self.before_layer is not None:
                self.before_layer(i)
            x = layer(x, *(local if layer.local_rope else rope), kv_cache, meta.for_layer(i))
        return self.norm(x[:num_tokens])

    def _fused_layers(
        self, x: Tensor, rope: tuple[Tensor, Tensor], local: tuple[Tensor, Tensor], kv_caches: list[KVCache],
        meta: AttentionMetadata, num_tokens: int,
    ) -> Tensor:
        """The layer loop of `forward` on the fused ops (every layer `fusable`, bf16 or float32 rows)."""
        residual = None
        before = self.before_layer
        grouped = meta.layer_metas is not None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if before is not None:
                before(i)
            cos, sin = local if layer.local_rope else rope
            x, residual = layer.fused_forward(x, residual, cos, sin, kv_cache, meta.for_layer(i) if grouped else meta)
        if residual is None:  # no layers
            return self.norm(x[:num_tokens])
        return fused.add_rms_norm(x[:num_tokens], residual[:num_tokens], self.norm.weight, self.norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self._packed_head is not None:
            logits = self._packed_head(hidden.contiguous()).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
            logits = F.linear(hidden, weight).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def pack_cpu_weights(self, q4_kernels: bool = False) -> None:
        """Swap every projection (and the LM head) for a oneDNN-packed copy, once the weights
        are loaded (a plain frozen copy where oneDNN cannot pack the dtype: bf16 on AVX2);
        the embedding table stays as it is for the lookup. With `q4_kernels`, a projection
        whose weights are exactly 4-bit groups also keeps those for small batches, and the LM
        head its exact Q8_0 groups (float32 or bfloat16). Batch-invariant (the default, see
        `kernels.batch_invariant`): groups serve only where their kernel gives the dense
        GEMM's bits (the bf16 or float32 lanes kernels, `lanes_groups`), so the row count never
        changes a row."""
        if self._packed_head is not None:
            return
        dense_linear = PackedLinear if can_pack_weights("cpu", self.embed_tokens.weight.dtype) else FrozenLinear
        q4_kernels = q4_kernels and q4_linear_available()
        bf16 = self.embed_tokens.weight.dtype == torch.bfloat16
        invariant = batch_invariant()
        if invariant and dense_linear is not PackedLinear:
            q4_kernels = False  # no kernel reproduces the unpacked GEMM's order
        vector_rows, max_rows = row_limits(bf16, invariant=invariant) if q4_kernels else (0, 0)
        served_q4 = 0

        def exact(name: str, dense: nn.Module, sizes: tuple[int, ...]) -> tuple[Tensor, ...] | None:
            groups = self.quant_groups.pop(name, None)  # dropped as they are repacked, not all at the end
            if not q4_kernels or groups is None or len(groups) not in sizes:
                return None
            if invariant:
                biased = getattr(dense, "bias", None) is not None
                return None if biased else lanes_groups(dense, groups, self.embed_tokens.weight.dtype)
            return groups

        for i, layer in enumerate(tqdm(self.layers, desc="packing weights", unit="layer", leave=False, disable=None)):
            attn, mlp = layer.self_attn, layer.mlp
            for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
                lin = getattr(owner, name)
                packed: nn.Module = dense_linear(lin.weight, lin.bias)
                key = f"layers.{i}.{'self_attn' if owner is attn else 'mlp'}.{name}"
                groups = exact(key, packed, (3, 2))  # Q4_1, or Q8_0 (int8 on load)
                if groups is not None:
                    kind = Q4Linear if len(groups) == 3 else Q8Linear
                    packed, served_q4 = kind(packed, groups, packed.bias, max_rows, vector_rows), served_q4 + 1
                setattr(owner, name, packed)
        head_name = "embed_tokens.weight" if self.lm_head is None else "lm_head"
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        self._packed_head = dense_linear(head, None)
        head_groups = exact(head_name, self._packed_head, (2,))
        if head_groups is not None:
            head_vector, head_max = row_limits(bf16, head=True, invariant=invariant)
            self._packed_head = Q8Linear(self._packed_head, head_groups, None, head_max, head_vector)
        self.quant_groups = {}
        self.q4_rows = max_rows if served_q4 else 0
        self._loop = self._decode_loop()
        if q4_kernels:
            logger.info("%d of %d projections also serve batches of <= %d rows from 4-bit groups%s%s",
                        served_q4, 4 * len(self.layers), max_rows,
                        f"; the LM head <= {self._packed_head.max_rows} rows from 8-bit groups"
                        if isinstance(self._packed_head, Q8Linear) else "",
                        " (bit for bit the dense GEMM's results)" if invariant else "")
            logger.info("decode-sized steps run %s", "the native layer loop" if self._loop else "the Python layer loop")

    def _decode_loop(self) -> fused.DecodeLoop | None:
        """The native decode loop, where every layer can take it: Llama-style norms and SiLU,
        no q/k norms, full rotary, all four projections on 4-bit groups without bias, one set
        of row limits and one norm epsilon."""
        if not (self._fusable and self.layers and decode_loop_available()):
            return None
        config = self.config
        if (config.rotary_dim or config.head_dim) != config.head_dim:
            return None
        weights: list[Tensor] = []
        limits, eps = set(), {self.norm.eps}
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.qk_norm or not all(type(p) is Q4Linear and p.bias is None for p in projs):
                return None
            limits |= {(p.max_rows, p.vector_rows) for p in projs}
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            weights += [layer.input_layernorm.weight, *attn.qkv_proj.groups, *attn.o_proj.groups,
                        layer.post_attention_layernorm.weight, *mlp.gate_up_proj.groups, *mlp.down_proj.groups]
        if len(limits) != 1 or len(eps) != 1:
            return None
        attn = self.layers[0].self_attn
        return fused.DecodeLoop(
            [w.detach() for w in weights], [int(layer.local_rope) for layer in self.layers],
            [layer.self_attn.window or 0 for layer in self.layers], self.norm.weight.detach(),
            attn.num_heads, attn.num_kv_heads, attn.scale, attn.softcap or 0.0, eps.pop(), attn.qkv_proj,
        )

    def warm_up_packed(self, max_tokens: int, max_logit_rows: int) -> None:
        """Pre-build oneDNN kernels for the padded sizes a step can produce up to WARM_UP_ROWS,
        fewer for layers larger than SmolLM2-135M's (one layer's projections suffice: kernels
        are shared by shape)."""
        # the LM head is ~16x a projection: its build is a tenth of its matmul by ~32 rows. A
        # larger model's matmuls outgrow the build sooner: the limits shrink with its layer.
        c = self.config
        layer_weights = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
        rows = max(8, WARM_UP_ROWS * WARM_UP_LAYER_WEIGHTS // layer_weights)
        max_tokens, max_logit_rows = min(max_tokens, rows), min(max_logit_rows, max(8, rows // 4))
        layer = self.layers[0]
        lins = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for lin in tqdm(lins, desc="building CPU kernels", unit="shape", leave=False, disable=None):
            dense = lin.dense if isinstance(lin, Q4Linear) else lin
            if isinstance(dense, PackedLinear):
                dense.warm_up(max_tokens)
        head = self._packed_head.dense if isinstance(self._packed_head, Q8Linear) else self._packed_head
        if isinstance(head, PackedLinear):
            head.warm_up(max_logit_rows)

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
