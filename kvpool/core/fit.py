"""The one search every budget check makes (the scheduler's chunks and decode steps, the KV
manager's plain decode steps): how much of something still fits."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(fits: Callable[[int], bool], most: int) -> int:
    """The largest n in 1..most with `fits(n)`, for a `fits` that holds up to some n and fails
    past it (block needs grow with n); 0 when not even 1 fits. By bisection: each probe sums a
    batch's block needs, so a probe per token would cost a long prompt's length."""
    if most < 1:
        return 0
    if fits(most):
        return most
    if not fits(1):
        return 0
    lo, hi = 1, most  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
