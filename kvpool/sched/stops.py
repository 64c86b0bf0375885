"""Stop conditions: a sampled token is appended and every stop condition applied in vLLM's order;
the tokens a sampler must not draw before `min_tokens`. The one place a sequence finishes."""

from __future__ import annotations

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.output import TextHook
from kvpool.sched.request import FinishReason, SeqStatus, Sequence, SequenceGroup


class Stops:
    """Token appends, stop checks and sequence finishes over the KV manager (a finished
    sequence's blocks are freed at once)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.num_generated_tokens = 0

    def early_stop_tokens(self, group: SequenceGroup, seq: Sequence) -> list[int]:
        """Tokens the sampler must not draw for `seq` now: below min_tokens, its stop token ids
        and (unless ignored) EOS, which would otherwise end it early (as in vLLM and HF)."""
        p = group.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(group.eos_token_ids))

    def append(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: float = 0.0,
        top: list[tuple[int, float]] | None = None, on_text: TextHook | None = None,
    ) -> bool:
        """Add a sampled token and apply every stop condition, in vLLM's order: nothing but the
        length limit below min_tokens; then a stop token id, EOS (not part of the text), a stop
        string (the driver's detokenizer finds and trims it), max_tokens. True if it finished."""
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        params = group.params
        if params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top or [])
        self.num_generated_tokens += 1
        n_out = len(seq.token_ids) - seq.prompt_len
        may_stop = n_out >= params.min_tokens
        if may_stop:
            if token_id in params.stop_token_ids:
                if on_text is not None:
                    on_text(group, seq, False)
                self.finish(seq, FinishReason.STOP, stop_reason=token_id)
                return True
            if not params.ignore_eos and token_id in group.eos_token_ids:
                self.finish(seq, FinishReason.STOP)
                return True
        if on_text is not None:
            stop = on_text(group, seq, may_stop and bool(params.stop))
            if stop is not None:
                self.finish(seq, FinishReason.STOP, stop_reason=stop)
                return True
        if n_out >= params.max_tokens:
            self.finish(seq, FinishReason.LENGTH)
            return True
        return False

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End `seq` for `reason` and free its blocks (a no-op on a finished sequence)."""
        if seq.is_finished:
            return
        if self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
