"""Stop conditions: a sampled token is appended and every stop condition applied in vLLM's order;
the tokens a sampler must not draw before `min_tokens`. The one place a sequence finishes."""

from __future__ import annotations

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.output import ConstraintHook
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
        top: list[tuple[int, float]] | None = None, constraint: ConstraintHook | None = None,
    ) -> bool:
        """Add a sampled token and apply every stop condition on token ids, in vLLM's order:
        nothing but the length limit below min_tokens; then a stop token id, EOS (not part of
        the text), the driver's output constraint complete, max_tokens. True if it finished.
        Stop strings come after, from the driver's text (`stop_string`)."""
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        params = group.params
        if params.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.top_logprobs.append(top or [])
        self.num_generated_tokens += 1
        n_out = len(seq.token_ids) - seq.prompt_len
        if n_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.finish(seq, FinishReason.STOP, stop_reason=token_id)
                return True
            if not params.ignore_eos and token_id in group.eos_token_ids:
                self.finish(seq, FinishReason.STOP)
                return True
        if constraint is not None and constraint(group, seq, token_id):
            self.finish(seq, FinishReason.STOP)
            return True
        if n_out >= params.max_tokens:
            self.finish(seq, FinishReason.LENGTH)
            return True
        return False

    def stop_string(self, seq: Sequence, stop: str) -> None:
        """The driver's text of `seq`'s newest token completes stop string `stop`: it stops
        there, also when that token had just reached max_tokens (a stop string ranks above the
        length limit, as in vLLM)."""
        if not seq.is_finished:
            self.finish(seq, FinishReason.STOP, stop_reason=stop)
        elif seq.finish_reason is FinishReason.LENGTH:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop

    @staticmethod
    def ends_on_eos(group: SequenceGroup, seq: Sequence) -> bool:
        """Did `seq` stop on EOS (its last token then is no part of its text)?"""
        return (seq.finish_reason is FinishReason.STOP and seq.stop_reason is None and not group.params.ignore_eos
                and seq.num_output_tokens > 0 and seq.token_ids[-1] in group.eos_token_ids)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End `seq` for `reason` and free its blocks (a no-op on a finished sequence)."""
        if seq.is_finished:
            return
        if self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
