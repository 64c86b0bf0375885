"""Where a token becomes text: incremental detokenization, stop strings and each step's delta.

The engine core works on token ids; after its `postprocess` the engine hands this processor
the groups the step touched, in two calls:

1. `detokenize(groups)` turns each sample's new tokens into text and looks for stop strings
   in it; it returns the hits, and the engine reports them to the core
   (`Scheduler.stop_at_strings`), which stops those sequences: a fate is decided in the core
   only, even where only text can tell.
2. `emit(group, ...)` then builds the request's record of what is new: new token ids, their
   logprobs, the new text and, on its last record, the finish reason the core decided.

Each step costs the size of what is new: the text that may still turn into a stop string
(the last `max(len(stop)) - 1` characters) is held back and searched, never the whole text.
`num_chars` counts the characters detokenized and emitted, for tests that check exactly that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.engine.controls import best_of
from kvpool.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpool.engine.tokenizer import IncrementalDetokenizer
from kvpool.sched.metrics import FirstTokenPhases
from kvpool.sched.output import ScheduledSeq
from kvpool.sched.request import FinishReason, Sequence, SequenceGroup
from kvpool.sched.stops import Stops

logger = logging.getLogger(__name__)

StopHit = tuple[Sequence, str]  # the sequence whose text completed a stop string, and the string


@dataclass(slots=True)
class _SeqText:
    """One sample's text: its detokenizer, the output tokens it has taken, the text not yet
    emitted (all of it for an output reported whole) and where this step's tokens began."""

    detok: IncrementalDetokenizer
    taken: int = 0
    held: str = ""
    step_from: int = 0
    closed: bool = False  # its finish has been reported
    parts: list[str] = field(default_factory=list)  # released text of an output reported whole

    def release(self, done: bool, holdback: int) -> str:
        """The held text that can no longer begin a stop string (all of it once done)."""
        held = self.held
        cut = len(held) if done else max(0, len(held) - holdback)
        if not cut:
            return ""
        self.held = held[cut:]
        return held[:cut]


@dataclass(slots=True)
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    holdback: int  # characters that may begin a stop string: never emitted before the finish
    whole: bool  # best_of / beam search: the chosen outputs are reported whole, at the finish
    texts: dict[int, _SeqText] = field(default_factory=dict)  # seq id -> its text
    reported_prompt: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self.num_chars = 0  # characters detokenized and emitted, over every request
        self._prefilling: dict[str, RequestMetrics] = {}  # this step's requests with no token yet

    def add(self, group: SequenceGroup, prompt: str | None, metrics: RequestMetrics) -> None:
        p = group.params
        holdback = max((len(s) for s in p.stop), default=1) - 1
        whole = p.use_beam_search or p.num_samples > p.n
        req = self._requests[group.request_id] = _Request(prompt, group.prompt_token_ids, metrics, holdback, whole)
        if group.beam is None:  # beams are decoded whole when they finish
            req.texts[group.seqs[0].seq_id] = self._new_text(group, req)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def scheduled(self, scheduled: list[ScheduledSeq], now: float) -> None:
        """The step ran these rows: a request's first time scheduled is now, and its prompt's
        KV sources are the record its store loads settle. Those with no token yet are kept for
        `timed`, which adds the step's phases to their time to first token."""
        requests = self._requests
        prefilling = self._prefilling = {}
        for s in scheduled:
            req = requests.get(s.group.request_id)
            if req is None:
                continue
            m = req.metrics
            if m.first_scheduled_s is None:
                m.first_scheduled_s = now
                m.prompt_sources = s.group.prompt_sources
            if not m.token_times:
                prefilling[s.group.request_id] = m

    def timed(self, start: float, *ends: float) -> None:
        """The step's start and the end of each of its phases (`FirstTokenPhases.add_step`):
        added to every request it ran that has no token yet."""
        for m in self._prefilling.values():
            if m.phases is None:
                m.phases = FirstTokenPhases(max(0.0, start - m.added_s) if m.added_s is not None else 0.0)
            m.phases.add_step(start, *ends)
        self._prefilling = {}

    # -- 1. text and stop strings ----------------------------------------------------------
    def detokenize(self, groups: list[SequenceGroup]) -> tuple[list[StopHit], dict[str, str]]:
        """Extend each sample's text by its new tokens. Returns the stop strings they complete,
        and the requests whose text failed (request id -> why; they fail alone)."""
        hits: list[StopHit] = []
        failed: dict[str, str] = {}
        for g in groups:
            req = self._requests.get(g.request_id)
            if req is None or g.beam is not None:  # beams are decoded whole when they finish
                continue
            try:
                for seq in g.seqs:
                    stop = self._extend(g, req, seq)
                    if stop is not None:
                        hits.append((seq, stop))
            except Exception as e:  # noqa: BLE001 - fails this request only
                logger.exception("detokenizing failed for request %s", g.request_id)
                failed[g.request_id] = f"detokenizing failed: {type(e).__name__}: {e}"
        return hits, failed

    def _extend(self, g: SequenceGroup, req: _Request, seq: Sequence) -> str | None:
        st = req.texts.get(seq.seq_id)
        if st is None:  # a sample forked this step: its text starts from the prompt
            st = req.texts[seq.seq_id] = self._new_text(g, req)
        st.step_from = taken = st.taken
        end = len(seq.token_ids)
        start = seq.prompt_len + taken
        if end == start:
            return None
        st.taken = end - seq.prompt_len
        if seq.finish_reason is not None and Stops.ends_on_eos(g, seq):
            end -= 1  # EOS is no part of the text
        new = st.detok.step(seq.token_ids[start:end]) if end > start else ""
        if not new:
            return None
        self.num_chars += len(new)
        before = len(st.held)
        st.held += new
        return self._stop_in(g, seq, st, before) if g.params.stop else None

    def _new_text(self, g: SequenceGroup, req: _Request) -> _SeqText:
        return _SeqText(IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               skip_special_tokens=g.params.skip_special_tokens))

    @staticmethod
    def _stop_in(g: SequenceGroup, seq: Sequence, st: _SeqText, before: int) -> str | None:
        """The first stop string that ends in the new text (`held[before:]`), trimming the text
        there; only where the core may still stop the sequence: not yet finished (or at its
        length limit this very token) and past min_tokens."""
        p = g.params
        if st.taken < p.min_tokens:  # `taken`: the sequence's output tokens, all taken now
            return None
        if seq.finish_reason is not None and seq.finish_reason is not FinishReason.LENGTH:
            return None
        held = st.held
        for stop in p.stop:
            at = held.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                st.held = held[: at + len(stop)] if p.include_stop_str_in_output else held[:at]
                return stop
        return None

    # -- 2. the step's record --------------------------------------------------------------
    def emit(self, g: SequenceGroup, finished: bool, error: str | None, now: float,
             prompt_logprobs: Callable[[str], tuple[list | None, list | None]]) -> RequestOutput | None:
        """The request's record of this step (None if it is not known here); a finished
        request is forgotten. Its prompt logprobs (`prompt_logprobs(request_id)`, complete once
        it samples) ride on its first record only."""
        req = self._requests.get(g.request_id)
        if req is None:
            return None
        req.metrics.on_token(now)
        if finished:
            req.metrics.finish(now)
            del self._requests[g.request_id]
        if req.whole:
            outs = self._whole(g, req, finished and error is None)
        else:
            outs = self._deltas(g, req, finished)
        lps, tops = (None, None) if req.reported_prompt else prompt_logprobs(g.request_id)
        req.reported_prompt = True
        return RequestOutput(g.request_id, req.prompt_token_ids, outs, finished, g.num_cached_prompt_tokens,
                             req.metrics, req.prompt, error, lps, tops)

    def _deltas(self, g: SequenceGroup, req: _Request, finished: bool) -> list[CompletionOutput]:
        want_lp = g.params.logprobs is not None
        outs = []
        for seq in g.seqs:  # in sample order: samples are forked in index order
            st = req.texts.get(seq.seq_id)
            if st is None or st.closed:
                continue
            done = seq.is_finished or finished
            if st.step_from == st.taken and not done:
                continue  # nothing new this step
            st.closed = done
            held = st.held
            cut = len(held) if done else len(held) - req.holdback  # inline `release`: once per sample per step
            if cut > 0:
                text, st.held = held[:cut], held[cut:]
                self.num_chars += cut
            else:
                text = ""
            a, b = st.step_from, st.taken
            p = seq.prompt_len
            outs.append(CompletionOutput(
                seq.sample_index, seq.token_ids[p + a : p + b], text,
                seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason, seq.cumulative_logprob,
                seq.logprobs[a:b] if want_lp else None, seq.top_logprobs[a:b] if want_lp else None,
            ))
            st.step_from = b
        return outs

    def _whole(self, g: SequenceGroup, req: _Request, report: bool) -> list[CompletionOutput]:
        """Nothing until the request finishes; then its chosen outputs, whole (best_of: the n
        best samples; beam search: the finished hypotheses, decoded now)."""
        if g.beam is not None:
            if not report:
                return []
            skip = g.params.skip_special_tokens
            return [CompletionOutput(i, ids, self.tokenizer.decode(ids, skip_special_tokens=skip), reason.value,
                                     None, score) for i, (score, ids, reason) in enumerate(g.beam.finished)]
        for seq in g.seqs:
            st = req.texts.get(seq.seq_id)
            if st is not None and st.held:
                st.parts.append(st.release(report or seq.is_finished, req.holdback))
        if not report:
            return []
        want_lp = g.params.logprobs is not None
        outs = []
        for index, seq in enumerate(best_of(g)):
            st = req.texts.get(seq.seq_id)
            outs.append(CompletionOutput(
                index, seq.output_ids, "".join(st.parts) if st is not None else "",
                seq.finish_reason.value if seq.finish_reason else None, seq.stop_reason, seq.cumulative_logprob,
                list(seq.logprobs) if want_lp else None, list(seq.top_logprobs) if want_lp else None,
            ))
        return outs
