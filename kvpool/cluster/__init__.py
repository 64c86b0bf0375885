"""Cluster conductor: KV-aware routing, P/D pairing, SLO admission and early rejection."""

from kvpool.cluster.conductor import Conductor, ConductorStats
from kvpool.cluster.index import POOL, GlobalKVIndex
from kvpool.cluster.predictor import (
    CostModelPredictor,
    FittedPredictor,
    LinearPredictor,
    StepTimePredictor,
    TransferCost,
)
from kvpool.cluster.records import ConductorConfig, InstanceLoad, RouteDecision, RouteRequest

__all__ = [
    "POOL",
    "Conductor",
    "ConductorConfig",
    "ConductorStats",
    "CostModelPredictor",
    "FittedPredictor",
    "GlobalKVIndex",
    "InstanceLoad",
    "LinearPredictor",
    "RouteDecision",
    "RouteRequest",
    "StepTimePredictor",
    "TransferCost",
]
