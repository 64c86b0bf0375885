"""The simulator's experiments: each module has `run(size, seed, out) -> ExperimentResult`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvpool.errors import ConfigError
from kvpool.sim.experiments.base import ExperimentResult

# name -> module, in the report's order
EXPERIMENTS = {
    "memory-waste": "memory_waste",
    "concurrency": "concurrency",
    "latency-rate": "latency_rate",
    "block-size": "block_size",
    "swap-recompute": "swap_recompute",
    "prefix-hit-rate": "prefix_hit_rate",
    "conductor-policies": "conductor_policies",
    "overload": "overload",
    "parallel-sampling": "parallel_sampling",
    "shared-prefix": "shared_prefix",
    "prefill-saved": "prefill_saved",
    "storage-vs-compute": "storage_vs_compute",
    "pipeline-prefill": "pipeline_prefill",
    "layerwise-prefill": "layerwise_prefill",
    "waiting-order": "waiting_order",
    "retention": "retention",
    "load-or-recompute": "load_plan",
}


def get_experiment(name: str) -> Callable[..., ExperimentResult]:
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    return importlib.import_module(f"kvpool.sim.experiments.{EXPERIMENTS[name]}").run
