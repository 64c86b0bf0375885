"""The engine: one `step()` = `schedule()`, the model and the sampler, `postprocess()`.

It is the real-time driver of the pure scheduler; the simulator is the other one. What a
request's fate is (forks, beams, stops, frees) is decided in the scheduler; the engine turns
logits into samples and tokens into text. A failure it can pin on requests fails only those:
a bad request is refused before it touches any state, an exception in one request's sampling
or text fails that request, and an exception in the shared forward fails the step's requests
(their blocks freed) and leaves the engine ready for the next step.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass

import torch

from kvpool.core.block_pool import KVEvents
from kvpool.core.layer_groups import LayerGroups, group_layers
from kvpool.core.miss_reasons import MissLedger
from kvpool.engine.config import (
    EngineConfig,
    available_host_memory,
    fixed_kv_bytes,
    kv_budget,
    resolve_kv_dtype,
)
from kvpool.engine.controls import Controls, best_of
from kvpool.engine.kv_io import KVStoreConnector
from kvpool.engine.kv_quant import QUANTIZED, bytes_per_token, row_width, storage_dtype
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampler import sample
from kvpool.engine.tokenizer import IncrementalDetokenizer
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.beam import beam_candidates
from kvpool.sched.instance_load import decode_accepts, load_report
from kvpool.sched.output import Sample, SchedulerOutput
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


@dataclass(slots=True)
class _Request:
    """What the engine keeps per request beside the scheduler's group: the prompt text, the
    per-sample generators (seed + sample index), the metrics clock and each sample's text."""

    prompt: str | None
    metrics: RequestMetrics
    generators: list[torch.Generator] | None
    texts: dict[int, _SeqText]


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = "cuda" if config.device == "auto" and torch.cuda.is_available() else config.device
        self.device = torch.device("cpu" if device == "auto" else device)
        self.dtype = DTYPES[config.dtype]
        self.loaded = loaded or load_model(config.model, dtype=self.dtype, device=self.device,
                                           quantization=config.quantization,
                                           reserve_bytes=fixed_kv_bytes(config.kv_cache_memory))
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
        # layer groups share one pool of blocks of group_size layers: the same memory holds G times as many
        groups = group_layers(mcfg.layer_windows, mcfg.num_layers, config.swa_freeing)
        model_block = bytes_per_token(self.kv_dtype, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim) * config.block_size
        num_blocks = (config.num_blocks or self._blocks_from_budget(model_block)) * groups.num_groups
        per_block = model_block // groups.num_groups
        num_host_blocks = parse_bytes(config.swap_space, "swap_space") // per_block
        if config.preemption_mode == "swap" and num_host_blocks < 1:
            raise InvalidRequest(f"swap_space {config.swap_space} holds no KV block ({per_block} bytes)")
        self.block_size = config.block_size
        self.namespace = f"{self.loaded.name}/{config.dtype}/{config.block_size}" + self._kv_suffix()
        store = self._make_store(groups)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching, eviction_policy=config.eviction_policy,
            preemption_mode=config.preemption_mode, scheduling_policy=config.scheduling_policy,
            num_host_blocks=num_host_blocks if config.preemption_mode == "swap" else 0,
            watermark=config.watermark, namespace=self.namespace,
            record_kv_events=store is not None or config.publish_kv_events, kv_group_windows=groups.windows,
        ))
        self.runner = ModelRunner(
            self.loaded, num_blocks, config.block_size,
            num_host_blocks if config.preemption_mode == "swap" else 0, self.dtype, self.device,
            pack_weights=config.cpu_weight_packing, q4_kernels=config.cpu_q4_kernels, max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, layer_groups=groups, kv_dtype=self.kv_dtype,
        )
        self.kv_store: KVStoreConnector | None = None
        if store is not None:
            self.kv_store = KVStoreConnector(store, self.runner, self.scheduler, config.kv_write_policy,
                                             layerwise=config.kv_layerwise_load)
            self.scheduler.external_kv = self.kv_store.lookup
        self.scheduler.kv.ledger = self.kv_store.miss_ledger() if self.kv_store else MissLedger.of(self.scheduler.kv)
        self._published = KVEvents()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at %d tokens: %.2fx",
            num_blocks // groups.num_groups, config.block_size, num_blocks // groups.num_groups * config.block_size,
            num_blocks * per_block / 2**20, self.max_model_len,
            num_blocks // groups.num_groups * config.block_size / self.max_model_len,
        )
        if groups.num_groups > 1:
            logger.info("KV layer groups: %d of %d layers (windows %s) share %d pool blocks; window groups free "
                        "what leaves the window (--no-swa-freeing keeps every block)", groups.num_groups,
                        groups.group_size, groups.windows, num_blocks)
        self._log_kv_dtype(per_block)
        self.controls = Controls(self.tokenizer, mcfg.vocab_size)  # penalties, grammars, prompt logprobs
        self._requests: dict[str, _Request] = {}
        self._failed: dict[str, str] = {}  # request id -> why, found while stepping
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens = 0

    def _store_configured(self) -> bool:
        c = self.config
        return parse_bytes(c.kv_host_memory, "kv_host_memory") > 0 or bool(c.kv_disk_path) or bool(c.kv_remote)

    def _make_store(self, groups: LayerGroups):
        """The tiered store, if configured; a layer-grouped model's blocks hold one group's layers
        (each group's under its own key), in a namespace of their own."""
        c, m = self.config, self.loaded.config
        if not self._store_configured():
            return None
        from kvpool.store.factory import make_store
        from kvpool.store.format import block_namespace, block_shape

        # the cache's own bytes travel: bf16 as uint16, int8 as int8, fp8 e4m3 as uint8 (scales inline)
        np_dtype = {"bfloat16": "uint16", "fp8_e4m3": "uint8"}.get(self.kv_dtype, self.kv_dtype)
        width = row_width(self.kv_dtype, m.head_dim)
        return make_store(
            parse_bytes(c.kv_host_memory, "kv_host_memory"), c.kv_disk_path, parse_bytes(c.kv_disk_size, "kv_disk_size"),
            c.kv_remote, c.kv_write_policy,
            block_namespace(self.loaded.name, c.dtype + self._kv_suffix(), c.block_size, m.num_layers,
                            m.num_kv_heads, m.head_dim, groups.windows if groups.num_groups > 1 else ()),
            block_shape(groups.group_size, c.block_size, m.num_kv_heads, width), np_dtype, c.eviction_policy,
            disk_codec=c.kv_disk_codec, remote_codec=c.kv_remote_codec,
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
        """What this instance reports to a conductor: the `InstanceLoad` fields, computed by the
        same core function as the simulator's (kvpool/sched/instance_load.py), plus queue
        lengths for people reading /internal/state ("running" counts sequences)."""
        sched = self.scheduler
        return {**asdict(load_report(sched)), "running": sched.num_running_seqs,
                "waiting": len(sched.waiting), "swapped": len(sched.swapped)}

    def decode_accepts(self, prompt_len: int, max_tokens: int) -> bool:
        """Would this instance, as a decode instance, take a prefilled request of `prompt_len`
        tokens that generates `max_tokens` more (the simulator's decode admission, same function)?"""
        return decode_accepts(self.scheduler, prompt_len, max_tokens)

    def close(self) -> None:
        if self.kv_store is not None:
            self.kv_store.close()

    def _events(self) -> KVEvents:
        events = self.scheduler.kv.drain_events()
        if self.config.publish_kv_events:
            self._published.stored.extend(events.stored)
            self._published.evicted.extend(events.evicted)
        return events

    def _blocks_from_budget(self, per_block: int) -> int:
        budget = kv_budget(self.config.kv_cache_memory, per_block // self.config.block_size, self.max_model_len,
                           available_host_memory())
        if budget < per_block:
            raise ConfigError(f"KV budget {budget} bytes holds no block; one block needs {per_block} bytes")
        return budget // per_block

    def _kv_suffix(self) -> str:
        """Namespace part pinning the KV dtype where it is not the model's: blocks written in
        one KV dtype are never read as another (prefix cache and every store tier)."""
        return "" if self.kv_dtype == self.config.dtype else f"/kv-{self.kv_dtype}"

    def _log_kv_dtype(self, per_block: int) -> None:
        m = self.loaded.config
        model_bytes = bytes_per_token(self.config.dtype, m.num_layers, m.num_kv_heads, m.head_dim) * self.block_size
        scales = " incl. one float32 scale per token and KV head" if self.kv_dtype in QUANTIZED else ""
        logger.info("KV cache dtype %s (%s storage): %d bytes per block%s = %.2fx the blocks of %s KV in the same budget",
                    self.kv_dtype, str(storage_dtype(self.kv_dtype)).removeprefix("torch."), per_block, scales,
                    model_bytes / per_block, self.config.dtype)
        if self.kv_dtype in QUANTIZED and self.device.type == "cuda":
            logger.info("quantized KV on CUDA: attention dequantizes on the torch path (the Triton kernel reads "
                        "float caches only)")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue a request. Atomic: every check runs before anything changes, so
        it raises InvalidRequest having changed nothing, or enters every structure."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}", param="params")
        params.validate()  # again: fields may have been assigned since construction
        vocab = self.loaded.config.vocab_size
        params.check_vocab(vocab)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise InvalidRequest(f"logprobs must be <= {self.config.max_logprobs}", param="logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise InvalidRequest(f"prompt_logprobs must be <= {self.config.max_logprobs}", param="prompt_logprobs")
        controls = self.controls.check(params)  # vocabulary-dependent checks; compiles a grammar
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest(f"request_id must be a string, got {request_id!r}", param="request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequest(f"cache_salt must be a string, got {cache_salt!r}", param="cache_salt")
        if arrival_time is not None and (not isinstance(arrival_time, int | float) or not math.isfinite(arrival_time)):
            raise InvalidRequest(f"arrival_time must be a finite number, got {arrival_time!r}", param="arrival_time")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text = None
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
                raise InvalidRequest(f"prompt token ids must be integers in 0..{vocab - 1}", param="prompt")
        if not token_ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        generators = None
        if params.seed is not None and not params.use_beam_search:
            generators = [torch.Generator(device=self.device).manual_seed(params.seed + i)
                          for i in range(params.num_samples)]
        seq = self.scheduler.new_sequence(token_ids)
        group = SequenceGroup(
            request_id, [seq], params, arrival_time if arrival_time is not None else time.monotonic(),
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
        )
        texts = {} if params.use_beam_search else {seq.seq_id: self._new_text(group, seq)}
        self.scheduler.add_request(group)  # the last check; from here nothing can fail
        metrics = RequestMetrics(request_id, group.arrival_time, len(token_ids),
                                 n_param=params.n, max_tokens_param=params.max_tokens)
        self._requests[request_id] = _Request(text, metrics, generators, texts)
        self.controls.add(request_id, controls)
        return request_id

    def abort(self, request_id: str) -> bool:
        group = self.scheduler.abort(request_id)
        self._requests.pop(request_id, None)
        self.controls.forget(request_id)
        return group is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. Requests that failed in it come back finished, with `error` set."""
        sched = self.scheduler
        out = sched.schedule()
        try:
            if self.kv_store is not None:
                self.kv_store.before_forward(out, self._events())
            elif self.config.publish_kv_events:
                self._events()
            if out.is_empty:
                if self.kv_store is not None:
                    self.kv_store.complete_loads()
                return []
            now = time.monotonic()
            ran = False
            try:
                logits = self.runner.execute(out, out.block_tables)
                ran = True
            finally:
                if self.kv_store is not None:
                    self.kv_store.after_forward(ran)  # layer-wise loads have landed whole
            self.controls.record_prompt(out.scheduled, self.runner)
        except Exception as e:  # noqa: BLE001 - the shared forward: fail this step's requests
            logger.exception("engine step failed; failing the %d request(s) it scheduled", len(out.scheduled))
            return self._fail_step(out, f"engine error: {type(e).__name__}: {e}")
        self.num_steps += 1
        for s in out.scheduled:
            m = self._requests[s.group.request_id].metrics
            if m.first_scheduled_s is None:
                m.first_scheduled_s = now
                m.prompt_sources = s.group.prompt_sources  # the same record its store loads settle
            if s.start < s.seq.prompt_len:
                self.num_prompt_tokens += min(s.start + s.num_new_tokens, s.seq.prompt_len) - s.start
        rows = out.sampling
        sampled = self._sample(rows, logits)
        touched = {s.group.request_id: s.group for s in rows}
        self._fail_marked(touched)
        try:
            finished = {g.request_id for g in sched.postprocess(out, sampled, self._on_text)}
        except Exception as e:  # noqa: BLE001 - a bookkeeping bug must not wedge the engine
            logger.exception("postprocess failed; failing the step's requests")
            return self._fail_step(out, f"engine error: {type(e).__name__}: {e}")
        self._fail_marked(touched)
        try:
            if self.kv_store is not None:
                self.kv_store.after_update(self._events())
                self.kv_store.complete_loads()
            elif self.config.publish_kv_events:
                self._events()
        except Exception:  # noqa: BLE001 - the store is best effort; the tokens are computed
            logger.exception("KV store write-through after the step failed")
        now = time.monotonic()
        results = []
        for rid, g in touched.items():
            req = self._requests.get(rid)
            if req is None:
                continue
            req.metrics.on_token(now)
            error = self._failed.pop(rid, None)
            done = rid in finished or error is not None
            if done:
                req.metrics.finish(now)
                del self._requests[rid]
            results.append(self._output(g, req, done, error))
            if done:
                self.controls.forget(rid)
        self._failed.clear()
        return results

    def _fail_step(self, out: SchedulerOutput, reason: str) -> list[RequestOutput]:
        """The forward (or the store around it) failed: fail every request whose KV it was to
        write or move (scheduled, swapped out or loading this step), freeing their blocks."""
        groups = {s.group.request_id: s.group for s in out.scheduled}
        groups.update({g.request_id: g for g in out.preempted if g in self.scheduler.swapped})
        groups.update({ld.group.request_id: ld.group for ld in out.kv_loads})
        now = time.monotonic()
        results = []
        for rid, g in groups.items():
            self.scheduler.abort(rid)
            req = self._requests.pop(rid, None)
            self.controls.forget(rid)
            if req is not None:
                req.metrics.finish(now)
                results.append(self._output(g, req, True, reason))
        return results

    def _fail_marked(self, touched: dict[str, SequenceGroup]) -> None:
        """Abort the requests whose own work (sampling, text) failed; they report their error."""
        for rid in self._failed:
            self.controls.forget(rid)
            group = self.scheduler.abort(rid)
            if group is not None:
                touched.setdefault(rid, group)

    def _sample(self, rows, logits: torch.Tensor) -> list[Sample | None]:
        """One Sample per sampling row: `num_samples` tokens for plain rows (each sample with its
        own generator), the best continuations for beam rows. A row whose sampling raises
        fails its request only (the batch is retried row by row to find it)."""
        sampled: list[Sample | None] = [None] * len(rows)
        plain, beam = [], []
        for i, s in enumerate(rows):
            (beam if s.group.beam is not None else plain).append(i)
        if plain:
            try:
                self._sample_plain(rows, plain, logits, sampled)
            except Exception:  # noqa: BLE001 - find the request it belongs to
                for i in plain:
                    try:
                        self._sample_plain(rows, [i], logits, sampled)
                    except Exception as e:  # noqa: BLE001
                        logger.exception("sampling failed for request %s", rows[i].group.request_id)
                        self._failed[rows[i].group.request_id] = f"sampling failed: {type(e).__name__}: {e}"
        if beam:
            groups: dict[str, list[int]] = {}
            for i in beam:
                groups.setdefault(rows[i].group.request_id, []).append(i)
            for rid, idx in groups.items():
                try:
                    m = beam_candidates(rows[idx[0]].group)
                    lp = torch.log_softmax(logits[torch.tensor(idx, dtype=torch.long)].float(), dim=-1)
                    top = torch.topk(lp, min(m, lp.shape[-1]), dim=-1)
                    for j, i in enumerate(idx):
                        sampled[i] = Sample(candidates=list(zip(top.indices[j].tolist(), top.values[j].tolist(),
                                                                strict=True)))
                except Exception as e:  # noqa: BLE001
                    logger.exception("beam step failed for request %s", rid)
                    self._failed[rid] = f"beam search failed: {type(e).__name__}: {e}"
        return sampled

    def _sample_plain(self, rows, idx: list[int], logits: torch.Tensor, sampled: list[Sample | None]) -> None:
        """Sample rows `idx` in one batch: row i gives `num_samples` tokens, sample j drawn with
        generator j (seed + j) of its request."""
        sched, controls = self.scheduler, self.controls
        take, params, spans, targets = [], [], [], []
        for i in idx:
            s = rows[i]
            g = s.group
            if g.params.max_tokens == 0:  # prompt logprobs only: done once the prompt is computed
                sched.finish_seq(s.seq, FinishReason.LENGTH)
                continue
            req = self._requests[g.request_id]
            first = s.seq.sample_index
            spans.append((i, len(take), s.num_samples))
            for j in range(s.num_samples):
                take.append(i)
                targets.append((g, s.seq))  # forked samples start where their parent is
                gen = req.generators[first + j] if req.generators is not None else None
                params.append(controls.row_params(g, s.seq, gen))
        if not take:
            return
        bans = [(at, n, banned) for i, at, n in spans if (banned := sched.early_stop_tokens(rows[i].group, rows[i].seq))]
        # a decode step's rows in order, nothing banned, need no gathered copy (1.5 MB at batch 8)
        in_order = not bans and len(take) == logits.shape[0] and take == list(range(len(take)))
        row_logits = logits if in_order else logits[torch.tensor(take, dtype=torch.long)]
        for at, n, banned in bans:
            row_logits[at : at + n, banned] = float("-inf")
        allowed = controls.allowed(targets, row_logits.device)  # grammar mask, None when unconstrained
        result = sample(row_logits, params) if allowed is None else sample(row_logits, params, allowed)
        for i, at, n in spans:
            want_top = rows[i].group.params.logprobs is not None and result.top_logprobs
            sampled[i] = Sample(result.token_ids[at : at + n], result.logprobs[at : at + n],
                                result.top_logprobs[at : at + n] if want_top else None)

    def _new_text(self, g: SequenceGroup, seq: Sequence) -> _SeqText:
        return _SeqText(IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.prompt_len],
                                               skip_special_tokens=g.params.skip_special_tokens))

    def _on_text(self, g: SequenceGroup, seq: Sequence, check_stops: bool) -> str | None:
        """The scheduler's detokenizer hook: extend the sample's text by its newest token and,
        when asked, report (and trim) a stop string the text now contains. Also on the last
        allowed token: a stop string that ends there still stops the text ("stop", trimmed)."""
        rid = g.request_id
        if rid in self._failed:
            return None
        try:
            texts = self._requests[rid].texts
            st = texts.get(seq.seq_id)
            if st is None:  # a sample forked this step: its text starts from the prompt
                st = texts[seq.seq_id] = self._new_text(g, seq)
            st.text += st.detok.step(seq.token_ids[-1:])
            if self.controls.accept(g, seq, seq.token_ids[-1]):  # the grammar is complete
                self.scheduler.finish_seq(seq, FinishReason.STOP)
                return None
            if not check_stops:
                return None
            for stop in g.params.stop:
                at = st.text.find(stop, max(0, len(st.text) - len(stop) - 16))
                if at >= 0:
                    st.text = st.text[: at + len(stop)] if g.params.include_stop_str_in_output else st.text[:at]
                    return stop
            return None
        except Exception as e:  # noqa: BLE001 - fails this request only
            logger.exception("detokenizing failed for request %s", rid)
            self._failed[rid] = f"detokenizing failed: {type(e).__name__}: {e}"
            return None

    def _output(self, g: SequenceGroup, req: _Request, finished: bool, error: str | None = None) -> RequestOutput:
        if g.beam is not None:
            outs = self._beam_outputs(g, finished and error is None)
        else:
            outs = []
            want_lp = g.params.logprobs is not None
            chosen = sorted(g.seqs, key=lambda s: s.sample_index)
            if g.params.num_samples > g.params.n:  # best_of: only the n best, once all are done
                chosen = best_of(g) if finished else []
            for index, seq in enumerate(chosen):
                st = req.texts.get(seq.seq_id)
                outs.append(CompletionOutput(
                    index, seq.output_ids, st.text if st is not None else "",
                    seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason,
                    seq.cumulative_logprob, list(seq.logprobs) if want_lp else None,
                    list(seq.top_logprobs) if want_lp else None,
                ))
        prompt_lps, prompt_top = self.controls.prompt_result(g.request_id)
        return RequestOutput(
            g.request_id, g.prompt_token_ids, outs, finished, g.num_cached_prompt_tokens,
            req.metrics, req.prompt, error, prompt_lps, prompt_top,
        )

    def _beam_outputs(self, g: SequenceGroup, finished: bool) -> list[CompletionOutput]:
        if not finished:
            return [CompletionOutput(i, b.output_ids, "") for i, b in enumerate(g.live_seqs)]
        skip = g.params.skip_special_tokens
        return [
            CompletionOutput(i, ids, self.tokenizer.decode(ids, skip_special_tokens=skip), reason.value, None, score)
            for i, (score, ids, reason) in enumerate(g.beam.finished)
        ]
