"""The engine in three stages: the input processor (validation and tokenization, the one
station: kvpool/engine/input_processor.py), the core on token ids (`schedule()`, the model
and the sampler, `postprocess()`), the output processor (text, stop strings and each step's
delta: kvpool/engine/output_processor.py).

It is the real-time driver of the pure scheduler; the simulator is the other one. What a
request's fate is (forks, beams, stops, frees) is decided in the scheduler: a grammar's end
is told to it through `postprocess`, a stop string (which only text shows) right after, by
`Scheduler.stop_at_strings`, before anything is reported. A failure the engine can pin on
requests fails only those: a bad request is refused before it touches any state, an
exception in one request's sampling or text fails that request, and an exception in the
shared forward fails the step's requests (their blocks freed) and leaves the engine ready.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import asdict

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
from kvpool.engine.controls import Controls
from kvpool.engine.host_memory import keep_freed_memory
from kvpool.engine.input_processor import EngineRequest, InputLimits, InputProcessor
from kvpool.engine.kv_io import KVStoreConnector
from kvpool.engine.kv_quant import QUANTIZED, bytes_per_token, row_width, storage_dtype
from kvpool.engine.loader import LoadedModel, load_model
from kvpool.engine.lora.adapters import AdapterSet, request_salt
from kvpool.engine.output_processor import OutputProcessor
from kvpool.engine.outputs import RequestMetrics, RequestOutput
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sample_rows import RowSampler
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.instance_load import decode_accepts, load_report
from kvpool.sched.output import SchedulerOutput
from kvpool.sched.request import Sequence, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig
from kvpool.sizes import parse_bytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        if self.device.type == "cpu":  # after the load and packing: their temporaries are returned as before
            keep_freed_memory()
        self.kv_store: KVStoreConnector | None = None
        if store is not None:
            self.kv_store = KVStoreConnector(store, self.runner, self.scheduler, config.kv_write_policy,
                                             layerwise=config.kv_layerwise_load, plan_loads=config.kv_load_plan,
                                             remote_layer_reads=config.kv_layerwise_remote_reads)
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
        self.controls = Controls(self.tokenizer, mcfg.vocab_size, self.device)  # generators, grammars, ...
        self.inputs = InputProcessor(
            self.tokenizer, InputLimits(mcfg.vocab_size, self.max_model_len, config.max_num_seqs, config.max_logprobs),
            capacity=self.scheduler.check_capacity, prepare=self.controls.prepare)
        self.outputs = OutputProcessor(self.tokenizer)
        self.sampler = RowSampler(self.scheduler, self.controls)
        self.lora: AdapterSet | None = None  # LoRA adapters, once kvpool.engine.lora.adapters.enable_lora attaches them
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
        block the cache holds.) `retention` is the latest reported for each block held now,
        its `until` in this engine's clock (`time.monotonic()`)."""
        events, self._published = self._published, KVEvents()
        pool = self.scheduler.kv.pool
        if pool.retention is not None:  # a pin between steps (POST /v1/kv/pin on an idle engine)
            events.retention.update(pool.retention.published((), pool.lookup))
        net = KVEvents()
        for h in dict.fromkeys(events.stored + events.evicted):
            (net.stored if pool.lookup(h) is not None else net.evicted).append(h)
        net.retention = {h: r for h, r in events.retention.items() if pool.lookup(h) is not None}
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
            self._published.retention.update(events.retention)  # the latest per block wins
        return events

    def _blocks_from_budget(self, per_block: int) -> int:
        # the KV lives on the model's device: its free memory, not the host's, bounds the budget
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else available_host_memory()
        budget = kv_budget(self.config.kv_cache_memory, per_block // self.config.block_size, self.max_model_len, free)
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
        """Validate (`InputProcessor.process`) and queue a request. Atomic: it raises
        InvalidRequest having changed nothing, or enters every structure."""
        return self.add(self.inputs.process(prompt, params, request_id, arrival_time, cache_salt))

    def add(self, req: EngineRequest) -> str:
        """Queue a request the input processor made."""
        request_id = req.request_id if req.request_id is not None else f"req-{next(self._ids)}"
        params = req.params
        salt = request_salt(self.lora, params, req.cache_salt)  # joined by its LoRA adapter's identity
        seq = self.scheduler.new_sequence(req.prompt_token_ids)
        group = SequenceGroup(
            request_id, [seq], params, req.arrival_time if req.arrival_time is not None else time.monotonic(),
            eos_token_ids=self.eos_token_ids, cache_salt=salt,
        )
        self.scheduler.add_request(group)  # refuses a request id in use; from here nothing can fail
        metrics = RequestMetrics(request_id, group.arrival_time, seq.prompt_len,
                                 n_param=params.n, max_tokens_param=params.max_tokens, added_s=time.monotonic(),
                                 retention_param=params.retention)
        self.outputs.add(group, req.prompt, metrics)
        self.controls.add(request_id, req.controls)
        return request_id

    def abort(self, request_id: str) -> bool:
        group = self.scheduler.abort(request_id)
        self._forget(request_id)
        return group is not None

    def _forget(self, request_id: str) -> None:
        self.outputs.forget(request_id)
        self.controls.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------
    def step(self, deliver: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One iteration: a record of what is new for each request it advanced. Requests that
        failed in it come back finished, with `error` set. With `deliver`, the records of
        unfinished requests are handed to it as soon as they are made, before the tiered store
        copies out the step's blocks (a first token does not wait for that copy), and the step
        returns the finished ones after it: their client may next ask another instance for that
        KV (a prefill instance's answer to the P/D relay)."""
        sched = self.scheduler
        start = time.monotonic()  # the step's phases: each prompt's time to first token (`outputs.timed`)
        out = sched.schedule(start)  # `now` for retention TTLs (core/retention.py)
        try:
            if self.kv_store is not None:
                self.kv_store.before_forward(out, self._events())
            elif self.config.publish_kv_events:
                self._events()
            if out.is_empty:
                if self.kv_store is not None:
                    self.kv_store.complete_loads()
                return []
            scheduled_at = time.monotonic()
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
        forwarded = time.monotonic()
        self.outputs.scheduled(out.scheduled, scheduled_at)
        for s in out.scheduled:
            if s.start < s.seq.prompt_len:
                self.num_prompt_tokens += min(s.start + s.num_new_tokens, s.seq.prompt_len) - s.start
        rows = out.sampling
        sampled = self.sampler.sample(rows, logits, self._failed)
        sampled_at = time.monotonic()
        touched = {s.group.request_id: s.group for s in rows if not s.rewound}  # a rewound row runs again
        self._fail_marked(touched)
        try:
            finished = {g.request_id for g in sched.postprocess(
                out, sampled, self._accept if self.controls.constrained else None)}
            postprocessed = time.monotonic()
            hits, failed = self.outputs.detokenize(list(touched.values()))
            self._failed.update(failed)
            if hits:  # the core stops them, before anything is reported or the store sees the step
                finished.update(g.request_id for g in sched.stop_at_strings(hits))
        except Exception as e:  # noqa: BLE001 - a bookkeeping bug must not wedge the engine
            logger.exception("postprocess failed; failing the step's requests")
            return self._fail_step(out, f"engine error: {type(e).__name__}: {e}")
        detokenized = time.monotonic()
        self._fail_marked(touched)
        now = time.monotonic()
        self.outputs.timed(start, scheduled_at, forwarded, sampled_at, postprocessed, detokenized)
        results = []
        for rid, g in touched.items():
            error = self._failed.pop(rid, None)
            done = rid in finished or error is not None
            record = self.outputs.emit(g, done, error, now, self.controls.prompt_result)
            if record is not None:
                results.append(record)
            if done:
                self.controls.forget(rid)
        self._failed.clear()
        if deliver is not None and results:  # unfinished requests' tokens go out before the store's write-through
            deliver([r for r in results if not r.finished])
            results = [r for r in results if r.finished]
        try:
            if self.kv_store is not None:
                self.kv_store.after_update(self._events())
                self.kv_store.complete_loads()
            elif self.config.publish_kv_events:
                self._events()
        except Exception:  # noqa: BLE001 - the store is best effort; the tokens are computed
            logger.exception("KV store write-through after the step failed")
        return results

    def _accept(self, g: SequenceGroup, seq: Sequence, token: int) -> bool:
        """The scheduler's constraint hook: is the sequence's grammar complete with `token`? (A
        grammar that fails fails its request only.)"""
        if g.request_id in self._failed:
            return False
        try:
            return self.controls.accept(g, seq, token)
        except Exception as e:  # noqa: BLE001 - fails this request only
            logger.exception("grammar step failed for request %s", g.request_id)
            self._failed[g.request_id] = f"grammar failed: {type(e).__name__}: {e}"
            return False

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
            record = self.outputs.emit(g, True, reason, now, self.controls.prompt_result)
            self.controls.forget(rid)
            if record is not None:
                results.append(record)
        return results

    def _fail_marked(self, touched: dict[str, SequenceGroup]) -> None:
        """Abort the requests whose own work (sampling, text) failed; they report their error."""
        for rid in self._failed:
            self.controls.forget(rid)
            group = self.scheduler.abort(rid)
            if group is not None:
                touched.setdefault(rid, group)
