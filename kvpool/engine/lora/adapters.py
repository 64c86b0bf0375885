"""The adapters an engine serves and how one step applies them.

`AdapterSet` holds every loaded adapter (at most `max_loras`, all resident), refuses to unload
one that an unfinished request uses, and before each forward pass (`begin`) groups the step's
rows by adapter. Each decoder layer's projections then call `LayerLora.add`, which adds
`(x @ A.T) @ B.T * scaling` to the rows of each group, in float32 (as PEFT computes it with
its float32 adapter weights) and rounded once to the model's dtype. A step with no adapter row
sets no groups: the layers skip the hook after one attribute check, and the model keeps its
fused paths (the native decode loop included), so base-only steps run as they do without LoRA.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from kvpool.core.hashing import adapter_salt, check_salt
from kvpool.engine.lora.config import LoraConfig
from kvpool.engine.lora.peft_dir import LoraAdapter, load_adapter
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.output import ScheduledSeq
from kvpool.sched.request import SequenceGroup

logger = logging.getLogger(__name__)


class AdapterInUse(InvalidRequest):
    """An adapter cannot be unloaded while unfinished requests use it."""


class AdapterSet:
    """The engine's adapters by name, and the current step's row groups (`groups`)."""

    def __init__(self, model, config: LoraConfig) -> None:
        self.model_config = model.config
        self.device = model.embed_tokens.weight.device
        self.config = config
        self.adapters: dict[str, LoraAdapter] = {}
        self.groups: list[tuple[LoraAdapter, Tensor]] | None = None  # None: no adapter row this step

    # -- loading -------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, reserved: Iterable[str] = ()) -> LoraAdapter:
        """Load a PEFT directory as `name`; refused by name when the name is taken (the base
        model's names in `reserved` included), the set is full or the adapter does not fit."""
        if not isinstance(name, str) or not name or not name.strip():
            raise InvalidRequest(f"a LoRA adapter needs a non-empty name, got {name!r}", param="lora_name")
        if name in self.adapters or name in reserved:
            raise InvalidRequest(f"the name {name!r} is already served; unload it first or choose another",
                                 param="lora_name")
        if len(self.adapters) >= self.config.max_loras:
            raise InvalidRequest(f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loras "
                                 f"({self.config.max_loras}) allows; unload one first", param="lora_name")
        try:
            adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.device)
        except ConfigError as e:
            raise InvalidRequest(str(e), param="lora_path") from None
        self.adapters[name] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %d projections)", name, path, adapter.rank,
                    sum(len(layer) for layer in adapter.layers))
        return adapter

    def unload(self, name: str, unfinished: Iterable[SequenceGroup]) -> None:
        """Drop an adapter, unless a request that is not finished uses it (its rows would lose
        their weights mid-generation): that is refused, naming how many."""
        if name not in self.adapters:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        users = sum(1 for g in unfinished if g.params.lora == name)
        if users:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {users} unfinished request(s); "
                               "retry once they finish", param="lora_name")
        del self.adapters[name]
        logger.info("LoRA adapter %r unloaded", name)

    def salt(self, name: str | None, cache_salt: str | None) -> str | None:
        """The salt a request's blocks hash under: its own, or with its adapter's identity."""
        check_salt(cache_salt)
        if name is None:
            return cache_salt
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded", param="model")
        return adapter_salt(cache_salt, adapter.key)

    # -- one step --------------------------------------------------------------------------
    def begin(self, scheduled: Sequence[ScheduledSeq]) -> None:
        """Group the step's rows (in `scheduled` order, `num_new_tokens` each) by adapter."""
        names = [s.group.params.lora for s in scheduled]
        if not any(names):
            self.groups = None
            return
        order = {n: i for i, n in enumerate(dict.fromkeys(n for n in names if n))}
        ids = torch.tensor([order[n] + 1 if n else 0 for n in names], device=self.device)
        lens = torch.tensor([s.num_new_tokens for s in scheduled], device=self.device)
        row_adapter = torch.repeat_interleave(ids, lens)
        groups = []
        for n, i in order.items():
            adapter = self.adapters.get(n)
            if adapter is None:
                raise InvalidRequest(f"no LoRA adapter named {n!r} is loaded", param="model")
            groups.append((adapter, (row_adapter == i + 1).nonzero().squeeze(1)))
        self.groups = groups

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


class LayerLora:
    """One decoder layer's view of the set: what its projections call after the base matmul."""

    __slots__ = ("layer", "lora")

    def __init__(self, lora: AdapterSet, layer: int) -> None:
        self.lora, self.layer = lora, layer

    def add(self, proj: str, x: Tensor, out: Tensor) -> Tensor:
        """`out` (the base projection of `x`, padding rows included) plus each row's adapter delta."""
        groups = self.lora.groups
        if groups is None:
            return out
        for adapter, rows in groups:
            delta = adapter.layers[self.layer].get(proj)
            if delta is None:
                continue
            h = x.index_select(0, rows).float() @ delta.a.T
            summed = out.index_select(0, rows).float() + (h @ delta.b.T) * adapter.scaling
            out.index_copy_(0, rows, summed.to(out.dtype))
        return out


def attach(model, config: LoraConfig) -> AdapterSet:
    """Give `model` (a `LlamaForCausal`) an adapter set and each layer its hooks."""
    lora = AdapterSet(model, config)
    model.lora = lora
    for i, layer in enumerate(model.layers):
        layer.self_attn.lora = layer.mlp.lora = lora.layer(i)
    return lora


def enable_lora(engine, config: LoraConfig) -> AdapterSet:
    """Attach an adapter set to `engine` (an `Engine`) before it serves anything."""
    engine.lora = attach(engine.runner.model, config)
    return engine.lora


def request_salt(lora: AdapterSet | None, params, cache_salt: str | None) -> str | None:
    """The salt a request's blocks hash under (its adapter's identity joined to its own salt);
    refuses an adapter the engine does not serve, by name."""
    if lora is None:
        if params.lora is not None:
            raise InvalidRequest(f"LoRA adapter {params.lora!r} requested but this engine serves no "
                                 "adapters (--enable-lora)", param="model")
        check_salt(cache_salt)
        return cache_salt
    return lora.salt(params.lora, cache_salt)
