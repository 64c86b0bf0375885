"""The cluster conductor: KV-aware routing, P/D pairing, SLO admission and early rejection.

Pure like `kvpool.core` and `kvpool.sched` (no torch, clock or I/O): the gateway
(`kvpool.cluster`, real instances over HTTP) and the simulator (`kvpool.sim`, virtual time)
drive the same objects."""

from kvpool.conductor.conductor import Conductor, ConductorStats
from kvpool.conductor.index import POOL, GlobalKVIndex
from kvpool.conductor.predictor import (
    CostModelPredictor,
    FittedPredictor,
    LinearPredictor,
    StepTimePredictor,
    TransferCost,
)
from kvpool.conductor.records import ConductorConfig, InstanceLoad, RouteDecision, RouteRequest

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
