"""How many tokens each live sequence of a group computes in a step, within what is left of the
step's token budget: decode tokens are all or nothing, prefill chunks share what is left."""

from __future__ import annotations

from kvpool.sched.request import Sequence


def tokens_wanted(live: list[Sequence], budget: int, chunked: bool) -> list[int] | None:
    """Tokens of each of `live` this step (0 = sits out), or None if the group cannot run.
    Without chunked prefill a prompt runs whole or not at all."""
    if len(live) == 1:  # the common case, on the hot path
        seq = live[0]
        remaining = len(seq.token_ids) - seq.num_computed_tokens
        if remaining == 1:
            return [1] if budget >= 1 else None
        if remaining < 1:
            return None
        take = min(remaining, budget) if chunked else remaining
        return [take] if 0 < take <= budget else None
    wanted = [0] * len(live)
    for i, seq in enumerate(live):
        if len(seq.token_ids) - seq.num_computed_tokens == 1:
            wanted[i] = 1
    budget -= sum(wanted)
    if budget < 0:
        return None
    for i, seq in enumerate(live):
        remaining = len(seq.token_ids) - seq.num_computed_tokens
        if remaining > 1:
            take = min(remaining, budget) if chunked else remaining
            if take > budget:
                return None
            wanted[i] = take
            budget -= take
    return wanted if any(wanted) else None
