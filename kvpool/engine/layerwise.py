"""Layer-wise loading of store hits, the engine's part: a background thread writes a
`LayerwisePlan` (kvpool/sched/layerwise.py) into the device KV cache one layer at a time and
sets an event per layer; the model's per-layer hook waits for layer l before computing it, so
writing layer l+1 overlaps computing layer l. On CUDA the writes run on a side stream and the
hook makes the compute stream wait for that layer's CUDA event (the host does not block on
the GPU). A layer-grouped model's blocks hold one group's layers: the thread writes block layer
j (layer j of every group) and model layer l waits for its own (`LayerwisePlan.slot_of`).

`trace` records, in order, ("loaded", l) when layer l has landed and ("compute", l) when the
forward passes the hook of layer l: the ordering the tests check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from kvpool.sched.layerwise import LayerwisePlan

logger = logging.getLogger(__name__)


class LayerwiseLoadError(RuntimeError):
    """Writing store KV into the device cache failed: the step cannot use the plan."""


class LayerwiseWriter:
    """`read_layer(l)` (the tier read, which may hang) then `write_layer(l, data)` (the device
    write) for each layer on a loader thread. A forward that waits `timeout_s` for a layer gives
    the load up: from then on nothing is written (a read that returns late is dropped) and every
    later wait returns at once; `timed_out` tells the caller to recompute what the plan held."""

    def __init__(self, plan: LayerwisePlan, read_layer: Callable[[int], Any], write_layer: Callable[[int, Any], None],
                 device: torch.device, timeout_s: float = 10.0) -> None:
        self.plan = plan
        self._read_layer = read_layer
        self._write_layer = write_layer
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self.timed_out = False
        layers = len(plan.layers())
        self._ready = [threading.Event() for _ in range(layers)]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._device = device
        self._cuda_events: list[torch.cuda.Event | None] = [None] * layers
        self._error: BaseException | None = None
        self._waited = 0
        self.stall_s = 0.0  # how long the forward sat in `wait` (its share of the load on the critical path)
        self.trace: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._run, name="kv-layerwise", daemon=True)

    def start(self) -> LayerwiseWriter:
        self._thread.start()
        return self

    def wait(self, layer: int) -> None:
        """The model's hook before it computes `layer`: returns once that layer's KV has landed."""
        slot = self.plan.slot_of(layer)
        if slot is not None and slot < len(self._ready):
            start = time.perf_counter()
            if not self._ready[slot].wait(self._timeout_s):
                self._give_up()
            self.stall_s += time.perf_counter() - start
            if self._error is not None:
                raise LayerwiseLoadError(f"writing layer {slot} of {self.plan.num_blocks} store blocks "
                                         f"failed: {self._error}") from self._error
            event = self._cuda_events[slot]
            if event is not None:
                torch.cuda.current_stream(self._device).wait_event(event)
            self._waited = max(self._waited, slot + 1)
        self.trace.append(("compute", layer))

    def _give_up(self) -> None:
        with self._lock:  # after this no write starts, and none is under way
            self.timed_out = True
        logger.warning("a layer-wise KV load waited %.1f s for a tier read; its sequences recompute", self._timeout_s)
        for ready in self._ready:
            ready.set()

    def join(self, check_waited: bool = True) -> None:
        """Wait for every layer (the blocks must be whole before anyone else may read or reuse
        them); raise if a forward that ran computed a layer it had not waited for. A load given
        up is not waited for: its thread writes nothing more."""
        if self.timed_out:
            return
        self._thread.join()
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        if self._error is not None:
            raise LayerwiseLoadError(f"writing {self.plan.num_blocks} store blocks failed: {self._error}") \
                from self._error
        if check_waited and self._waited != len(self._ready):
            raise LayerwiseLoadError(f"the forward waited for {self._waited} of {len(self._ready)} layers "
                                     "of a layer-wise load (the model's per-layer hook was not called)")

    def _run(self) -> None:
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        try:
            with torch.inference_mode(), stream:
                for layer in self.plan.layers():
                    data = self._read_layer(layer)
                    with self._lock:
                        if self.timed_out:
                            return
                        self._write_layer(layer, data)
                    if self._stream is not None:
                        event = torch.cuda.Event()
                        event.record(self._stream)
                        self._cuda_events[layer] = event
                    self.trace.append(("loaded", layer))
                    self._ready[layer].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the forward, which raises it
            self._error = exc
            for ready in self._ready:
                ready.set()
