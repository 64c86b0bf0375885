"""What an instance tells the conductor (`InstanceLoad`), and whether a decode instance takes a
prefilled request: one pure function each over the instance's scheduler, so that the real
instances (the engine, behind `kvpool serve --role`) and the simulated ones report and decide
the same way for the same state. Here, below the engine, so that both drivers can call them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.sched.request import SeqStatus

if TYPE_CHECKING:
    from kvpool.sched.scheduler import Scheduler

# Predicted decode step time (s) for a batch of `num_seqs` with `context_tokens` in total.
DecodeStepTime = Callable[[int, int], float]


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What an instance reports about itself; the conductor adds its own estimates on top
    between two reports. `decode_context_tokens` is the total context of its running
    decode batch (0 when unknown); `free_kv_blocks` counts evictable cached blocks as free;
    `total_kv_blocks` 0 means "no KV limit reported"."""

    queued_prefill_tokens: int = 0
    running_decode_reqs: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    decode_context_tokens: int = 0


def load_report(sched: Scheduler) -> InstanceLoad:
    """The instance's load: tokens still to prefill (waiting and running sequences with more
    than their newest token to compute), running requests, free KV blocks and the total
    context of the sequences decoding."""
    queued = 0
    ctx = 0
    for queue in (sched.waiting, sched.running):
        for g in queue:
            for seq in g.seqs:
                if seq.status is SeqStatus.FINISHED:
                    continue
                n = len(seq.token_ids)
                left = n - seq.num_computed_tokens
                if left > 1:
                    queued += left
                else:
                    ctx += n
    return InstanceLoad(
        queued_prefill_tokens=queued,
        running_decode_reqs=len(sched.running),
        free_kv_blocks=sched.kv.num_free_blocks,
        total_kv_blocks=sched.config.num_blocks,
        decode_context_tokens=ctx,
    )


def decode_accepts(
    sched: Scheduler,
    prompt_len: int,
    output_len: int,
    tbt_slo_s: float | None = None,
    decode_step_time: DecodeStepTime | None = None,
) -> bool:
    """A decode instance refuses work it cannot hold: KV for the whole request (`prompt_len`
    tokens whose KV arrives, `output_len` to generate) plus the prompts already waiting beyond
    its free blocks; or, with a TBT SLO and a predictor, a predicted step time over the SLO for
    everything running or waiting plus this request, at the decoding context plus its prompt."""
    kv = sched.kv  # blocks over every layer group (a window group holds fewer)
    need = kv.max_blocks(prompt_len, prompt_len + output_len)
    queued = sum(kv.max_blocks(len(g.seqs[0].token_ids), len(g.seqs[0].token_ids)) for g in sched.waiting)
    if need + queued > sched.kv.num_free_blocks:
        return False
    if tbt_slo_s is None or decode_step_time is None:
        return True
    batch = len(sched.running) + len(sched.waiting) + 1
    return decode_step_time(batch, load_report(sched).decode_context_tokens + prompt_len) <= tbt_slo_s
