"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV cache.

The model sees flat token batches only: ids, positions, per-layer KV caches and the
attention metadata. Sequences, sharing and scheduling live above it.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kvpool.engine.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kvpool.engine.kernels import q4_linear_available
from kvpool.engine.models.quantized import MAX_ROWS as MAX_Q4_ROWS
from kvpool.engine.models.quantized import Q4Linear, q4_groups
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model; the loader fills it from the checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Llama 3.1-style rope frequency scaling ("default" | "llama3" | "linear").
    rope_scaling_type: str = "default"
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling_type not in ("default", "llama3", "linear"):
            raise ConfigError(
                f"rope scaling {self.rope_scaling_type!r} unsupported; use default, llama3 or linear"
            )

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * layer + h

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V one token occupies across all layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def fingerprint(self) -> str:
        """Short stable hash of the config, used to namespace the prefix cache."""
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:10]


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


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse rotary frequencies, with Llama 3 / linear scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if config.rope_scaling_type == "linear":
        inv = inv / config.rope_scaling_factor
    elif config.rope_scaling_type == "llama3":
        low_wl = config.rope_original_max_position / config.rope_low_freq_factor
        high_wl = config.rope_original_max_position / config.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / config.rope_scaling_factor, inv)
        smooth = (config.rope_original_max_position / wavelen - config.rope_low_freq_factor) / (
            config.rope_high_freq_factor - config.rope_low_freq_factor
        )
        blended = (1 - smooth) * scaled / config.rope_scaling_factor + smooth * scaled
        mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(mid, blended, scaled)
    return inv


class Rotary(nn.Module):
    """Cos/sin tables indexed by position, HF's rotate_half convention (halves, not pairs)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.set_inv_freq(rope_inv_freq(config))

    def set_inv_freq(self, inv_freq: Tensor) -> None:
        pos = torch.arange(self.config.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq.to(torch.float64))
        device = self.cos.device
        self.cos = angles.cos().to(torch.float32).to(device)
        self.sin = angles.sin().to(torch.float32).to(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """[T, 1, D/2] cos and sin for the given positions."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; rotates first/second halves as HF's rotate_half does."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused QKV projection; rope on Q and K together; KV written to slots, then paged attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        t = meta.num_tokens  # x may carry padding rows past them (see LlamaForCausal.forward)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)[:t]
        qk = apply_rotary(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, new_kv=(k, v)).reshape(t, h * d)
        return self.o_proj(pad_rows(out, x.shape[0]))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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


def can_pack_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class LlamaForCausal(nn.Module):
    """The decoder; `forward` returns final-normed hidden states, `compute_logits` projects."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.lm_head: nn.Parameter | None = None
        self._packed_head: PackedLinear | None = None
        self.q4_rows = 0  # batches up to this many rows run on 4-bit weights
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.randn(config.vocab_size, config.hidden_size) * 0.02)

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
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x[:num_tokens])

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self._packed_head is not None:
            return self._packed_head(hidden.contiguous()).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def pack_cpu_weights(self, q4_kernels: bool = False) -> None:
        """Swap every projection (and the LM head) for a oneDNN-packed copy, once the weights
        are loaded; the embedding table stays as it is for the lookup. With `q4_kernels`, a
        projection whose weights are exactly 4-bit groups also keeps those for small batches."""
        if self._packed_head is not None:
            return
        q4_kernels = q4_kernels and q4_linear_available()
        served_q4 = 0
        for layer in tqdm(self.layers, desc="packing weights", unit="layer", leave=False, disable=None):
            attn, mlp = layer.self_attn, layer.mlp
            for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
                lin = getattr(owner, name)
                packed: nn.Module = PackedLinear(lin.weight, lin.bias)
                groups = q4_groups(lin.weight) if q4_kernels else None
                if groups is not None:
                    packed, served_q4 = Q4Linear(packed, groups, packed.bias), served_q4 + 1
                setattr(owner, name, packed)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        self._packed_head = PackedLinear(head, None)
        self.q4_rows = MAX_Q4_ROWS if served_q4 else 0
        if q4_kernels:
            logger.info("%d of %d projections also serve batches of <= %d rows from 4-bit groups",
                        served_q4, 4 * len(self.layers), MAX_Q4_ROWS)

    def warm_up_packed(self, max_tokens: int, max_logit_rows: int) -> None:
        """Pre-build oneDNN kernels for every padded size a step can produce (one layer's
        projections suffice: kernels are shared by shape)."""
        layer = self.layers[0]
        lins = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for lin in tqdm(lins, desc="building CPU kernels", unit="shape", leave=False, disable=None):
            dense = lin.dense if isinstance(lin, Q4Linear) else lin
            if isinstance(dense, PackedLinear):
                dense.warm_up(max_tokens)
        if self._packed_head is not None:
            self._packed_head.warm_up(max_logit_rows)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...), fusing QKV and
        gate/up. Raises ConfigError naming any tensor missing or unexpected."""
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
                pending.pop(f"{pre}mlp.gate_proj.weight", None),
                pending.pop(f"{pre}mlp.up_proj.weight", None),
            )
            if gate is not None and up is not None:
                put(f"{pre}mlp.gate_up_proj.weight", torch.cat([gate, up], dim=0))
        for name, value in pending.items():
            put(name, value)
        missing = set(params) - loaded
        if missing:
            raise ConfigError(
                f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
            )
