"""A predictor with round numbers for the conductor tests."""

import pytest
from conductor_helpers import make_predictor

from kvpool.conductor import LinearPredictor


@pytest.fixture
def predictor() -> LinearPredictor:
    return make_predictor()
