"""A predictor with round numbers for the conductor tests."""

import pytest
from cluster_helpers import make_predictor

from kvpool.cluster import LinearPredictor


@pytest.fixture
def predictor() -> LinearPredictor:
    return make_predictor()
