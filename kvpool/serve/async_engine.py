"""The synchronous engine behind an asyncio front: one thread owns the engine.

The HTTP side never touches the engine directly. It sends commands through a thread-safe
queue; the engine thread applies them between steps and hands each step's deltas back to
per-request asyncio queues with `call_soon_threadsafe`. When nothing is unfinished the
thread sleeps on the command queue, so an idle server costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.engine.outputs import OutputAccumulator, RequestOutput
from kvpool.errors import InvalidRequest, KVPoolError, Overloaded
from kvpool.sched.sampling_params import SamplingParams
from kvpool.serve.errors import ShuttingDown
from kvpool.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    """Queue several engine requests at once (one per prompt), all or none."""

    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None
    sink: asyncio.Queue
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread and resolve `done` with its result."""

    fn: Callable[[Any], Any]
    done: asyncio.Future


@dataclass(slots=True)
class _Stop:
    pass


@dataclass(slots=True)
class _AbortAll:
    """End every request in flight with `ShuttingDown` (the drain's deadline passed)."""

    reason: str


@dataclass(slots=True)
class _Route:
    sink: asyncio.Queue
    index: int
    generated: dict[int, int] = field(default_factory=dict)  # output index -> tokens so far (metrics)


@dataclass(slots=True)
class AsyncEngine:
    engine: Any  # kvpool.engine.engine.Engine; typed loosely so this module imports without torch
    metrics: ServerMetrics
    max_queue: int | None = None
    retry_after_s: float = 1.0
    watchdog_s: float = 60.0  # no step completes for this long while work is pending: unhealthy
    _commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _routes: dict[str, _Route] = field(default_factory=dict)  # engine thread only
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _draining: bool = False
    _ids: int = 0
    _busy: bool = False  # the engine thread has work (not asleep on the command queue)
    _produced: bool = False  # the step running now has handed over outputs
    _beat: float = field(default_factory=time.monotonic)  # the last time it made progress or went idle

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def launch(
        cls, build: Callable[[], Any], make_metrics: Callable[[Any], ServerMetrics], **kwargs: Any
    ) -> AsyncEngine:
        """Build the engine on the thread that will step it; return once it is loaded.

        Every torch op must run on that one thread. libgomp keeps a worker pool per thread
        that opens parallel regions; with two pools on a 2-core machine its workers stop
        spinning between regions, and each decode step took ~50% longer (18 -> 27 ms)."""
        built: queue.SimpleQueue = queue.SimpleQueue()

        def main() -> None:
            try:
                engine = build()
                this = cls(engine, make_metrics(engine), **kwargs)
            except BaseException as e:  # handed to the caller, which re-raises it
                built.put(e)
                return
            this._thread = threading.current_thread()
            this.metrics.update(engine)  # the KV gauges are right before the first request
            built.put(this)
            this._started.wait()
            this._run()

        threading.Thread(target=main, name="kvpool-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def start(self) -> None:
        """Begin stepping, delivering outputs to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._started.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> str | None:
        """None when healthy, else why not: the engine thread died, or it has had work pending
        for `watchdog_s` without completing a step (stuck in a step, or spinning without
        scheduling anything)."""
        if not self.alive:
            return "the engine thread is not running"
        stalled = time.monotonic() - self._beat
        if self._busy and stalled > self.watchdog_s:
            return f"the engine made no progress for {stalled:.0f} s with work pending"
        return None

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests the engine still holds (read from the event loop; a snapshot)."""
        return len(self._routes)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let in-flight requests finish for up to `timeout_s`, then end the rest
        with a ShuttingDown error (a stream gets it as an error event)."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight and self.alive:
            logger.warning("shutdown: aborting %d request(s) still in flight", self.num_in_flight)
            await self.call(lambda _: None, _AbortAll("the server shut down before this request finished"))

    async def shutdown(self, timeout_s: float) -> None:
        """Drain (see `drain`), then stop the engine thread."""
        await self.drain(timeout_s)
        self._commands.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # -- the HTTP side ---------------------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}-{time.time_ns() % 10**9}"

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        arrival_time: float,
        cache_salt: str | None = None,
        received: float | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Queue one engine request per prompt, all or none, and return their outputs' stream.

        Raises InvalidRequest / Overloaded if the engine refuses (nothing stays queued then).
        The stream yields (prompt index, the output's delta) until every prompt finishes;
        leaving it early (client gone) aborts whatever is unfinished. `received`: when its HTTP
        request began (the TTFT breakdown's start; `arrival_time` if unknown).
        """
        submitted = time.monotonic()  # arrival to here: the front's work (validation, tokenization)
        if self._draining:
            raise ShuttingDown("the server is shutting down", retry_after_s=self.retry_after_s)
        if self.max_queue is not None and len(prompts) > self.max_queue:  # never admissible: no retry helps
            raise InvalidRequest(f"the request holds {len(prompts)} prompts; this server queues at most "
                                 f"{self.max_queue} (--max-queue): send fewer per request", param="prompt")
        loop = asyncio.get_running_loop()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        sink: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._commands.put(_Add(ids, [list(p) for p in prompts], params, arrival_time, cache_salt, sink, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self._commands.put(_Abort(ids))
            raise
        return self._outputs(ids, sink, (arrival_time if received is None else received, submitted))

    async def _outputs(self, ids: list[str], sink: asyncio.Queue, front: tuple[float, float],
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        unfinished = set(range(len(ids)))
        delivered: set[int] = set()  # prompts whose first token reached the client (TTFT breakdown)
        try:
            while unfinished:
                backlog: dict[int, list[RequestOutput]] = {}
                item = await sink.get()
                while True:  # coalesce: a slow reader gets one record per prompt, its deltas folded
                    if isinstance(item, BaseException):
                        raise item
                    backlog.setdefault(item[0], []).append(item[1])
                    if sink.empty():
                        break
                    item = sink.get_nowait()
                for index, deltas in backlog.items():
                    out = deltas[0] if len(deltas) == 1 else _fold(deltas)
                    if out.finished:
                        unfinished.discard(index)
                    yield index, out
                    # resumed: the caller has written what it made of `out` (a stream's chunk is sent)
                    if index not in delivered and out.metrics.first_token_time is not None:
                        delivered.add(index)
                        self.metrics.observe_first_token(out.metrics, *front, time.monotonic())
        finally:
            if unfinished:
                self._commands.put(_Abort([ids[i] for i in unfinished]))

    async def call(self, fn: Callable[[Any], Any], before: _AbortAll | None = None) -> Any:
        """Run `fn(engine)` between two steps (e.g. reset the prefix cache)."""
        done = asyncio.get_running_loop().create_future()
        if before is not None:
            self._commands.put(before)
        self._commands.put(_Call(fn, done))
        return await done

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle_step = False
        while True:
            pending = engine.has_unfinished()
            if not pending:
                self._busy = False
                self._beat = time.monotonic()
            try:  # a step that scheduled nothing (e.g. waiting on KV loads) waits a little, not spins
                commands = [self._commands.get(block=not pending or idle_step, timeout=0.005 if pending else None)]
            except queue.Empty:
                commands = []
            self._busy = True
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._abort_all("the server is shutting down", ShuttingDown)
                    self.metrics.update(engine)
                    engine.close()  # finishes pending KV store writes
                    return
                self._apply(cmd)
            idle_step = False
            if engine.has_unfinished():
                steps = getattr(engine, "num_steps", None)
                produced = self._step()
                if produced or getattr(engine, "num_steps", None) != steps:
                    self._beat = time.monotonic()
                else:
                    idle_step = True
            self.metrics.update(engine)

    def _apply(self, cmd: _Add | _Abort | _Call | _AbortAll) -> None:
        engine = self.engine
        if isinstance(cmd, _AbortAll):
            self._abort_all(cmd.reason, ShuttingDown)
            return
        if isinstance(cmd, _Abort):
            for rid in cmd.request_ids:
                if self._routes.pop(rid, None) is not None and engine.abort(rid):
                    self.metrics.aborted.inc()
            return
        if isinstance(cmd, _Call):
            try:
                self._resolve(cmd.done, cmd.fn(engine), None)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                self._resolve(cmd.done, None, e)
            self._beat = time.monotonic()
            return
        waiting, asked = len(engine.scheduler.waiting), len(cmd.request_ids)
        if self.max_queue is not None and waiting + asked > self.max_queue:  # transient: the queue drains
            self.metrics.rejected.inc()
            self._resolve(cmd.accepted, None, Overloaded(
                f"the admission queue is full: {waiting} of at most {self.max_queue} requests are waiting "
                f"and this one adds {asked}; retry later", retry_after_s=self.retry_after_s,
            ))
            return
        added: list[str] = []
        try:
            for rid, prompt in zip(cmd.request_ids, cmd.prompts, strict=True):
                engine.add_request(prompt, cmd.params, request_id=rid, arrival_time=cmd.arrival_time,
                                   cache_salt=cmd.cache_salt)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - refused: nothing of this request stays queued
            for rid in added:
                engine.abort(rid)
            self._resolve(cmd.accepted, None, e)
            return
        for i, rid in enumerate(added):
            self._routes[rid] = _Route(cmd.sink, i)
        self._resolve(cmd.accepted, True, None)

    def _step(self) -> bool:
        """One engine step; True if it produced outputs. They are handed over as soon as the
        engine has them (`Engine.step`'s `deliver`: before its store saves the step's blocks)."""
        self._produced = False
        try:
            self._hand_over(self.engine.step(self._hand_over))
        except Exception as e:  # noqa: BLE001 - fail the requests, keep the server up
            logger.exception("engine step failed; aborting every request in flight")
            self._abort_all(f"engine error: {e}")
            return True
        return self._produced

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Route a step's records to their requests' streams (engine thread)."""
        self._produced = self._produced or bool(outputs)
        batch = []
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            # A request the engine failed on its own (its sampling, text or forward) ends with
            # an error for its client alone; the requests beside it carry on.
            item = KVPoolError(out.error) if out.error is not None else (route.index, out)
            batch.append((route.sink, item))
            for c in out.outputs:
                route.generated[c.index] = route.generated.get(c.index, 0) + len(c.token_ids)
            if out.finished:
                del self._routes[out.request_id]
                self.metrics.observe_finished(out, list(route.generated.values()))
        if batch:
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _abort_all(self, reason: str, error: type[KVPoolError] = KVPoolError) -> None:
        batch = []
        for rid, route in self._routes.items():
            self.engine.abort(rid)
            self.metrics.aborted.inc()
            batch.append((route.sink, error(reason)))
        self._routes.clear()
        if batch:
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _resolve(self, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
        self._loop.call_soon_threadsafe(_settle, fut, result, error)


def _fold(deltas: list[RequestOutput]) -> RequestOutput:
    acc = OutputAccumulator()
    for d in deltas:
        acc.add(d)
    return acc.result()


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller went away
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
