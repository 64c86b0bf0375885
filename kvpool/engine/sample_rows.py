"""The run stage's last part: one step's logits into a `Sample` per sampling row.

Plain rows draw `num_samples` tokens (sample j with its request's generator j) in one batched
call; beam rows give their best continuations. A row whose sampling raises fails its request
only: the plain batch is retried row by row to find it. What a sample means for the request
(forks, stops, the length limit) the scheduler decides in `postprocess`.
"""

from __future__ import annotations

import logging

import torch

from kvpool.engine.controls import Controls
from kvpool.engine.sampler import sample
from kvpool.sched.beam import beam_candidates
from kvpool.sched.output import Sample, ScheduledSeq
from kvpool.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


class RowSampler:
    def __init__(self, scheduler: Scheduler, controls: Controls) -> None:
        self.scheduler = scheduler
        self.controls = controls

    def sample(self, rows: list[ScheduledSeq], logits: torch.Tensor, failed: dict[str, str]) -> list[Sample | None]:
        """One Sample per row (None where its request failed: why, in `failed` by request id)."""
        sampled: list[Sample | None] = [None] * len(rows)
        plain, beam = [], []
        for i, s in enumerate(rows):
            if not s.rewound:  # its KV was bad (Scheduler.rewind): it runs again, nothing drawn now
                (beam if s.group.beam is not None else plain).append(i)
        if plain:
            try:
                self._plain(rows, plain, logits, sampled)
            except Exception:  # noqa: BLE001 - find the request it belongs to
                for i in plain:
                    try:
                        self._plain(rows, [i], logits, sampled)
                    except Exception as e:  # noqa: BLE001
                        logger.exception("sampling failed for request %s", rows[i].group.request_id)
                        failed[rows[i].group.request_id] = f"sampling failed: {type(e).__name__}: {e}"
        if beam:
            self._beams(rows, beam, logits, sampled, failed)
        return sampled

    def _beams(self, rows: list[ScheduledSeq], beam: list[int], logits: torch.Tensor,
               sampled: list[Sample | None], failed: dict[str, str]) -> None:
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
                failed[rid] = f"beam search failed: {type(e).__name__}: {e}"

    def _plain(self, rows: list[ScheduledSeq], idx: list[int], logits: torch.Tensor,
               sampled: list[Sample | None]) -> None:
        """Sample rows `idx` in one batch: row i gives `num_samples` tokens, sample j drawn with
        generator j (seed + j) of its request."""
        sched, controls = self.scheduler, self.controls
        take, params, spans, targets = [], [], [], []
        for i in idx:
            s = rows[i]
            g = s.group
            if g.params.max_tokens == 0:  # prompt logprobs only: nothing to draw (the core ends it)
                sampled[i] = Sample()
                continue
            first = s.seq.sample_index
            spans.append((i, len(take), s.num_samples))
            for j in range(s.num_samples):
                take.append(i)
                targets.append((g, s.seq))  # forked samples start where their parent is
                params.append(controls.row_params(g, s.seq, first + j))
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
