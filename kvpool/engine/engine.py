"""The engine: one `step()` = schedule, move blocks, run the model, sample, bookkeep.

It is the real-time driver of the pure scheduler; the simulator is the other one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvpool.core.block_pool import KVEvents
from kvpool.engine.beam import BeamState, beam_step
from kvpool.engine.config import EngineConfig, available_host_memory
from kvpool.engine.controls import Controls, best_of
from kvpool.engine.kv_io import KVStoreConnector
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.engine.models.llama import num_blocks_for_budget
from kvpool.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampler import sample
from kvpool.engine.tokenizer import IncrementalDetokenizer
from kvpool.errors import InvalidRequest
from kvpool.sched.request import FinishReason, Sequence, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig
from kvpool.sizes import parse_bytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _SeqText:
    detok: IncrementalDetokenizer
    text: str = ""
    generator: torch.Generator | None = None


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = "cuda" if config.device == "auto" and torch.cuda.is_available() else config.device
        self.device = torch.device("cpu" if device == "auto" else device)
        self.dtype = DTYPES[config.dtype]
        self.loaded = loaded or load_model(config.model, dtype=self.dtype, device=self.device)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        num_blocks = config.num_blocks or self._blocks_from_budget()
        per_block = mcfg.kv_bytes_per_token(self.dtype) * config.block_size
        num_host_blocks = parse_bytes(config.swap_space, "swap_space") // per_block
        if config.preemption_mode == "swap" and num_host_blocks < 1:
            raise InvalidRequest(f"swap_space {config.swap_space} holds no KV block ({per_block} bytes)")
        self.block_size = config.block_size
        self.namespace = f"{self.loaded.name}/{config.dtype}/{config.block_size}"
        store = self._make_store()
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching, eviction_policy=config.eviction_policy,
            preemption_mode=config.preemption_mode,
            num_host_blocks=num_host_blocks if config.preemption_mode == "swap" else 0,
            watermark=config.watermark, namespace=self.namespace,
            record_kv_events=store is not None or config.publish_kv_events,
        ))
        self.runner = ModelRunner(
            self.loaded, num_blocks, config.block_size,
            num_host_blocks if config.preemption_mode == "swap" else 0, self.dtype, self.device,
            pack_weights=config.cpu_weight_packing, q4_kernels=config.cpu_q4_kernels, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )
        self.kv_store: KVStoreConnector | None = None
        if store is not None:
            self.kv_store = KVStoreConnector(store, self.runner, self.scheduler, config.kv_write_policy)
            self.scheduler.external_kv = self.kv_store.lookup
        self._published = KVEvents()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at %d tokens: %.2fx",
            num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**20,
            self.max_model_len, num_blocks * config.block_size / self.max_model_len,
        )
        self.controls = Controls(self.tokenizer, mcfg.vocab_size)  # penalties, grammars, prompt logprobs
        self._texts: dict[int, _SeqText] = {}
        self._beams: dict[str, BeamState] = {}
        self._metrics: dict[str, RequestMetrics] = {}
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def _make_store(self):
        c, m = self.config, self.loaded.config
        if parse_bytes(c.kv_host_memory, "kv_host_memory") <= 0 and not c.kv_disk_path and not c.kv_remote:
            return None
        from kvpool.store.factory import make_store
        from kvpool.store.format import block_namespace, block_shape

        np_dtype = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}[c.dtype]
        return make_store(
            parse_bytes(c.kv_host_memory, "kv_host_memory"), c.kv_disk_path, parse_bytes(c.kv_disk_size, "kv_disk_size"),
            c.kv_remote, c.kv_write_policy,
            block_namespace(self.loaded.name, c.dtype, c.block_size, m.num_layers, m.num_kv_heads, m.head_dim),
            block_shape(m.num_layers, c.block_size, m.num_kv_heads, m.head_dim), np_dtype, c.eviction_policy,
        )

    def drain_kv_events(self) -> KVEvents:
        """The device cache's net change since the last call (needs `publish_kv_events`), for
        a conductor's global index: each hash registered or evicted meanwhile appears once, as
        stored if the cache holds it now, else as evicted. (The raw lists lose the order
        between a block's eviction and its re-registration, so replaying them could drop a
        block the cache holds.)"""
        events, self._published = self._published, KVEvents()
        pool = self.scheduler.kv.pool
        net = KVEvents()
        for h in dict.fromkeys(events.stored + events.evicted):
            (net.stored if pool.lookup(h) is not None else net.evicted).append(h)
        return net

    def load_report(self) -> dict[str, int]:
        sched = self.scheduler
        usage = sched.kv.usage()
        queued = sum(len(s.token_ids) - s.num_computed_tokens for g in sched.waiting for s in g.live_seqs)
        queued += sum(
            len(s.token_ids) - s.num_computed_tokens for g in sched.running for s in g.live_seqs if s.in_prefill
        )
        return {
            "queued_prefill_tokens": queued, "running": sched.num_running_seqs, "waiting": len(sched.waiting),
            "swapped": len(sched.swapped), "free_kv_blocks": usage.free_blocks, "total_kv_blocks": usage.total_blocks,
        }

    def close(self) -> None:
        if self.kv_store is not None:
            self.kv_store.close()

    def _events(self) -> KVEvents:
        events = self.scheduler.kv.drain_events()
        if self.config.publish_kv_events:
            self._published.stored.extend(events.stored)
            self._published.evicted.extend(events.evicted)
        return events

    def _blocks_from_budget(self) -> int:
        budget = parse_bytes(self.config.kv_cache_memory, "kv_cache_memory", available_host_memory())
        return num_blocks_for_budget(self.loaded.config, budget, self.config.block_size, self.dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequest and changes nothing on bad input."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text = None
            token_ids = list(prompt)
            vocab = self.loaded.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
                raise InvalidRequest(f"prompt token ids must be integers in 0..{vocab - 1}", param="prompt")
        if not token_ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequest(f"logprobs must be <= {self.config.max_logprobs}", param="logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise InvalidRequest(f"prompt_logprobs must be <= {self.config.max_logprobs}", param="prompt_logprobs")
        controls = self.controls.check(params)
        seq = self.scheduler.new_sequence(token_ids)
        group = SequenceGroup(
            request_id, [seq], params, arrival_time if arrival_time is not None else time.monotonic(),
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
        )
        self.scheduler.add_request(group)
        self.controls.add(request_id, controls)
        self._metrics[request_id] = RequestMetrics(group.arrival_time, n_param=params.n, max_tokens_param=params.max_tokens)
        self._prompts[request_id] = text
        if params.use_beam_search:
            self._beams[request_id] = BeamState()
        else:
            self._track(group, seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        group = self.scheduler.abort(request_id)
        if group is None:
            return False
        self._forget(group)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        out = sched.schedule()
        if self.kv_store is not None:
            self.kv_store.before_forward(out, self._events())
        elif self.config.publish_kv_events:
            self._events()
        if out.is_empty:
            if self.kv_store is not None:
                self.kv_store.complete_loads()
            return []
        now = time.monotonic()
        tables = [sched.kv.block_table(s.seq.seq_id) for s in out.scheduled]
        logits = self.runner.execute(out, tables)
        self.controls.record_prompt(out.scheduled, self.runner)
        sched.update(out)
        if self.kv_store is not None:
            self.kv_store.after_update(self._events())
            self.kv_store.complete_loads()
        elif self.config.publish_kv_events:
            self._events()
        self.num_steps += 1
        touched: dict[str, SequenceGroup] = {}
        for s in out.scheduled:
            m = self._metrics[s.group.request_id]
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            if s.start < s.seq.prompt_len:
                self.num_prompt_tokens += min(s.start + s.num_new_tokens, s.seq.prompt_len) - s.start
        self._sample(out, logits, touched)
        now = time.monotonic()
        for g in touched.values():
            m = self._metrics[g.request_id]
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            m.token_times.append(now)
        finished = {g.request_id for g in sched.free_finished()}
        results = []
        for rid, g in touched.items():
            if rid in finished:
                self._metrics[rid].finished_time = now
            results.append(self._output(g, rid in finished))
            if rid in finished:
                self._forget(g)
        return results

    def _sample(self, out, logits: torch.Tensor, touched: dict[str, SequenceGroup]) -> None:
        sched = self.scheduler
        beam_rows: dict[str, list[int]] = {}
        rows, targets = [], []  # per sampled row: (group, seq)
        for i, s in enumerate(x for x in out.scheduled if x.samples):
            g, seq = s.group, s.seq
            if seq.is_finished:
                continue
            touched[g.request_id] = g
            if g.params.max_tokens == 0:  # prompt logprobs only
                sched.finish_seq(g, seq, FinishReason.LENGTH)
                continue
            if g.params.use_beam_search:
                beam_rows.setdefault(g.request_id, []).append(i)
                continue
            if g.params.num_samples > 1 and not g.forked:
                g.forked = True
                for _ in range(g.params.num_samples - 1):
                    child = sched.fork(g, seq)
                    child.sample_index = len(g.seqs) - 1
                    self._track(g, child)
                    rows.append(i)
                    targets.append((g, child))
            rows.append(i)
            targets.append((g, seq))
        if rows:
            params = [self.controls.row_params(g, seq, self._texts[seq.seq_id].generator) for g, seq in targets]
            row_logits = logits[torch.tensor(rows, dtype=torch.long)]
            self._mask_early_stops(row_logits, targets)
            result = sample(row_logits, params, self.controls.allowed(targets, row_logits.device))
            for j, (g, seq) in enumerate(targets):
                token = result.token_ids[j]
                if g.params.logprobs is not None:
                    seq.logprobs.append(result.logprobs[j])
                    seq.top_logprobs.append(result.top_logprobs[j] if result.top_logprobs else [])
                done = sched.append_token(g, seq, token, result.logprobs[j])
                self.num_generated_tokens += 1
                self._detok(g, seq, token, done)
                if not seq.is_finished and self.controls.accept(g, seq, token):
                    sched.finish_seq(g, seq, FinishReason.STOP)  # the grammar is complete
        for rid, idx in beam_rows.items():
            g = sched.groups[rid]
            beams = g.live_seqs
            before = sum(len(b.token_ids) for b in beams)
            beam_step(sched, g, self._beams[rid], beams, logits[torch.tensor(idx, dtype=torch.long)])
            self.num_generated_tokens += max(0, sum(len(b.token_ids) for b in g.live_seqs) - before)

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, targets: list[tuple[SequenceGroup, Sequence]]) -> None:
        """Below min_tokens, EOS and stop tokens cannot be sampled (as in vLLM and HF)."""
        for row, (g, seq) in enumerate(targets):
            if seq.num_output_tokens < g.params.min_tokens:
                banned = list(g.params.stop_token_ids) + ([] if g.params.ignore_eos else list(g.eos_token_ids))
                if banned:
                    logits[row, banned] = float("-inf")

    def _track(self, g: SequenceGroup, seq: Sequence) -> None:
        gen = None
        if g.params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(g.params.seed + seq.sample_index)
        self._texts[seq.seq_id] = _SeqText(
            IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.prompt_len],
                                   skip_special_tokens=g.params.skip_special_tokens),
            generator=gen,
        )

    def _detok(self, g: SequenceGroup, seq: Sequence, token: int, done: bool) -> None:
        st = self._texts[seq.seq_id]
        if done and seq.finish_reason is FinishReason.STOP and seq.stop_reason is None and not g.params.ignore_eos:
            return  # EOS is not part of the text
        st.text += st.detok.step([token])
        if not g.params.stop or done:
            return
        for stop in g.params.stop:
            at = st.text.find(stop, max(0, len(st.text) - len(stop) - 16))
            if at >= 0:
                st.text = st.text[: at + len(stop)] if g.params.include_stop_str_in_output else st.text[:at]
                self.scheduler.finish_seq(g, seq, FinishReason.STOP, stop_reason=stop)
                return

    def _output(self, g: SequenceGroup, finished: bool) -> RequestOutput:
        if g.params.use_beam_search:
            outs = self._beam_outputs(g, finished)
        else:
            outs = []
            chosen = sorted(g.seqs, key=lambda s: s.sample_index)
            if g.params.num_samples > g.params.n:  # best_of: only the n best, once all are done
                chosen = best_of(g) if finished else []
            for index, seq in enumerate(chosen):
                st = self._texts[seq.seq_id]
                want_lp = g.params.logprobs is not None
                outs.append(CompletionOutput(
                    index, seq.output_ids, st.text,
                    seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
                    seq.cumulative_logprob, list(seq.logprobs) if want_lp else None,
                    list(seq.top_logprobs) if want_lp else None,
                ))
        prompt_lps, prompt_top = self.controls.prompt_result(g.request_id)
        return RequestOutput(
            g.request_id, g.prompt_token_ids, outs, finished, g.num_cached_prompt_tokens,
            self._metrics[g.request_id], self._prompts.get(g.request_id),
            prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_top,
        )

    def _beam_outputs(self, g: SequenceGroup, finished: bool) -> list[CompletionOutput]:
        state = self._beams[g.request_id]
        if not finished:
            return [CompletionOutput(i, b.output_ids, "") for i, b in enumerate(g.live_seqs)]
        skip = g.params.skip_special_tokens
        return [
            CompletionOutput(i, ids, self.tokenizer.decode(ids, skip_special_tokens=skip), reason.value, None, score)
            for i, (score, ids, reason) in enumerate(state.finished)
        ]

    def _forget(self, g: SequenceGroup) -> None:
        for seq in g.seqs:
            self._texts.pop(seq.seq_id, None)
        self._beams.pop(g.request_id, None)
        self.controls.forget(g)
        self._metrics.pop(g.request_id, None)
        self._prompts.pop(g.request_id, None)
