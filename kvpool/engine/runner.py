"""Scheduler output -> tensors -> model -> logits, plus the KV data movements of the step.

The model sees only a flat batch: token ids, positions, slots and block tables. Swap and
copy-on-write copies are carried out batched, before the forward pass, in the order that
keeps them safe: swap-out first (its device blocks may be reused this step), then swap-in,
then copies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from torch import Tensor

from kvpool.core.layer_groups import LayerGroups, group_layers
from kvpool.engine.attention import AttentionMetadata, KVCache
from kvpool.engine.kernels import fused_ops_available, paged_attention_available
from kvpool.engine.kv_quant import allocate_caches
from kvpool.engine.loader import LoadedModel
from kvpool.sched.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, num_host_blocks: int,
        dtype: torch.dtype, device: torch.device, pack_weights: bool = True, q4_kernels: bool = True,
        max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, layer_groups: LayerGroups | None = None,
        kv_dtype: str | None = None,
    ) -> None:
        self.model = loaded.model
        if device.type == "cpu":
            paged_attention_available()  # build (or load) the kernels now, not inside the first request's TTFT
            fused_ops_available()
        if pack_weights and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            self.model.pack_cpu_weights(q4_kernels)
            start = time.perf_counter()
            self.model.warm_up_packed(max_num_batched_tokens + max_num_seqs, max_num_seqs)
            logger.info("CPU kernels for decode-sized batches built in %.1fs", time.perf_counter() - start)
        self.config = loaded.config
        self.block_size = block_size
        self.device = device
        self.groups = layer_groups or group_layers((), loaded.config.num_layers)
        self.kv_dtype = kv_dtype or str(dtype).removeprefix("torch.")  # None: the model's dtype
        # kv_slots: the group_size (k, v) tensors every group shares; kv_caches: each layer's one
        self.kv_slots = self._allocate(num_blocks, device)
        self.kv_caches = [self.kv_slots[s] for s in self.groups.layer_slot]
        self.host_caches = self._allocate(num_host_blocks, "cpu") if num_host_blocks else []

    def _allocate(self, num_blocks: int, device: torch.device | str) -> list[KVCache]:
        size = self.groups.group_size
        config = self.config if size == self.config.num_layers else replace(
            self.config, num_layers=size, layer_windows=())
        return allocate_caches(config, num_blocks, self.block_size, self.kv_dtype, device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: list[list[int]]) -> Tensor:
        """Run one step; returns logits [num_sampling_seqs, vocab] in `out.scheduled` order
        of the sequences whose `samples` flag is set."""
        self._move_blocks(out)
        ids: list[int] = []
        qlens, slens = [], []
        last_rows = []
        row = 0
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            ids.extend(s.seq.token_ids[s.start : end])
            qlens.append(s.num_new_tokens)
            slens.append(end)
            row += s.num_new_tokens
            if s.samples:
                last_rows.append(row - 1)
        meta = AttentionMetadata.build(qlens, slens, block_tables, self.block_size, self.device)
        if out.group_block_tables:  # layer groups: each layer attends through its group's tables
            by_group = [meta if g == 0 else AttentionMetadata.build(qlens, slens, t, self.block_size, self.device)
                        for g, t in enumerate(out.group_block_tables)]
            meta.layer_metas = [by_group[g] for g in self.groups.layer_group]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.model.lora is not None:  # LoRA adapters: which rows take which adapter's deltas
            self.model.lora.begin(out.scheduled)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        self.last_hidden = hidden  # every computed row of the step, for prompt logprobs
        if not last_rows:
            return hidden.new_empty((0, self.config.vocab_size))
        if len(last_rows) == hidden.shape[0]:  # every row samples (a decode step): no gather
            return self.model.compute_logits(hidden)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))

    @torch.inference_mode()
    def token_logprobs(
        self, rows: list[int], next_ids: list[int], num_top: int, chunk: int = 256
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Prompt logprobs: log p(next_ids[i] | tokens up to row i) for rows of the last step's
        hidden states, through the same LM head as sampling, `chunk` rows at a time (a [rows, V]
        logits tensor for a long prompt would not fit); plus the `num_top` best per row."""
        chosen: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for at in range(0, len(rows), chunk):
            idx = torch.tensor(rows[at : at + chunk], dtype=torch.long, device=self.device)
            lp = self.model.compute_logits(self.last_hidden.index_select(0, idx)).float().log_softmax(-1)
            want = torch.tensor(next_ids[at : at + chunk], dtype=torch.long, device=self.device)
            chosen += lp.gather(1, want.unsqueeze(1)).squeeze(1).tolist()
            if num_top:
                values, ids = lp.topk(num_top, dim=-1)
                tops += [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            else:
                tops += [[] for _ in range(len(idx))]
        return chosen, tops

    def _move_blocks(self, out: SchedulerOutput) -> None:
        if out.swap_out:
            self._copy_across(out.swap_out, self.kv_slots, self.host_caches)
        if out.swap_in:
            self._copy_across(out.swap_in, self.host_caches, self.kv_slots)
        if out.copies:
            src = torch.tensor([c[0] for c in out.copies], device=self.device)
            dst = torch.tensor([c[1] for c in out.copies], device=self.device)
            for k, v in self.kv_slots:
                k.index_copy_(0, dst, k.index_select(0, src))
                v.index_copy_(0, dst, v.index_select(0, src))

    @staticmethod
    def _copy_across(mapping: list[tuple[int, int]], src_caches: list, dst_caches: list) -> None:
        src_ids = torch.tensor([m[0] for m in mapping])
        dst_ids = torch.tensor([m[1] for m in mapping])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
            s_idx, d_idx = src_ids.to(sk.device), dst_ids.to(dk.device)
            dk.index_copy_(0, d_idx, sk.index_select(0, s_idx).to(dk.device))
            dv.index_copy_(0, d_idx, sv.index_select(0, s_idx).to(dv.device))
