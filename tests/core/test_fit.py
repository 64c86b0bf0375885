"""The scheduler's one budget search: the largest amount that still fits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.fit import largest_fitting


@given(st.integers(0, 5000), st.integers(-2, 5002))
def test_largest_fitting_finds_the_threshold_with_few_probes(most, threshold):
    probes = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= threshold

    assert largest_fitting(fits, most) == max(0, min(most, threshold))
    assert all(1 <= n <= most for n in probes)
    assert len(probes) <= 3 + max(1, most).bit_length()
