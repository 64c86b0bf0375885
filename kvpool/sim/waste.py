"""Replay a workload through a contiguous-reservation baseline and average its slot breakdown.

Iteration-level, offline (every request queued at t=0, arrival times ignored): each step
admits FCFS while the head request fits, then every running request generates one token.
This isolates memory waste from timing; the paged counterpart runs the real KV manager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.contiguous import ContiguousKVManager, ReservationPolicy
from kvpool.errors import ConfigError
from kvpool.sim.workloads import SimRequest

PARTS = ("token_slots", "reserved_slots", "internal_frag_slots", "external_frag_slots", "free_slots")


@dataclass(slots=True, frozen=True)
class WasteReport:
    """Time-averaged fraction of the arena in each part, plus the batch it sustained."""

    policy: str
    steps: int
    mean_batch: float
    fractions: dict[str, float]


def replay_contiguous(
    requests: Sequence[SimRequest],
    num_slots: int,
    policy: ReservationPolicy,
    max_len: int = 2048,
    max_tokens: int | None = None,
    max_batch: int = 256,
) -> WasteReport:
    """Run `requests` to completion; a request's own maximum is prompt + max_tokens (default:
    the model's `max_len`), capped at `max_len`; outputs stop at that maximum."""
    mgr = ContiguousKVManager(num_slots, policy)
    queue = deque(requests)
    running: dict[str, int] = {}  # request id -> tokens still to generate
    totals = dict.fromkeys(PARTS, 0.0)
    steps = batch_sum = 0

    def limits(r: SimRequest) -> tuple[int, int, int]:
        own_max = max_len if max_tokens is None else min(max_len, r.prompt_len + max_tokens)
        if r.prompt_len >= own_max:
            raise ConfigError(f"{r.request_id}: prompt of {r.prompt_len} leaves no room under {own_max}")
        return r.prompt_len, own_max, min(r.prompt_len + r.output_len, own_max)

    while queue or running:
        while queue and len(running) < max_batch and mgr.can_admit(*limits(queue[0])):
            r = queue.popleft()
            prompt, own_max, final = limits(r)
            mgr.admit(r.request_id, prompt, own_max, final)
            running[r.request_id] = final - prompt
        if not running:
            raise ConfigError(f"{queue[0].request_id} can never fit in {num_slots} slots")
        head = queue[0] if queue else None
        usage = mgr.usage(policy.reserve(*limits(head)) if head else None)
        for part in PARTS:
            totals[part] += getattr(usage, part) / usage.total
        steps += 1
        batch_sum += len(running)
        for rid in list(running):
            mgr.append(rid)
            running[rid] -= 1
            if running[rid] == 0:
                mgr.free(rid)
                del running[rid]
    return WasteReport(
        policy=policy.name,
        steps=steps,
        mean_batch=batch_sum / max(steps, 1),
        fractions={p: v / max(steps, 1) for p, v in totals.items()},
    )
