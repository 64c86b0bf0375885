"""The published analyses the experiments reproduce (issue 17), on small sizes."""

import json
from dataclasses import replace

from kvpool.cli import main
from kvpool.sim.experiments import block_size, concurrency, swap_recompute
from kvpool.sim.experiments.base import roofline

BLOCK = concurrency.BLOCK


def _budget() -> int:
    _, blocks = roofline("opt-13b", "a100-40gb", block_size=BLOCK)
    return blocks * BLOCK


def test_swap_costs_more_than_recompute_for_tiny_blocks_and_less_for_large_ones():
    ratio = {}
    for b in (1, 16, 32, 256):
        cost, _ = roofline("opt-13b", "a100-40gb", block_size=b)
        swap, recompute = swap_recompute.recovery_times(cost, b)
        ratio[b] = swap / recompute
    assert ratio[1] > 1 > ratio[256]
    assert ratio[1] > ratio[16] > ratio[32] > ratio[256]
    crossover = swap_recompute.crossover_block_size(cost)
    assert 8 < crossover < 32


def test_fig13_order_max_pow2_oracle_paged_at_the_papers_sharegpt_rate():
    reqs = concurrency.workload("sharegpt", 120, concurrency.PAPER_RATES["sharegpt"], seed=0)
    b = concurrency.mean_batches(reqs, _budget())
    assert b["max"] < b["pow2"] < b["oracle"] < b["paged"]
    assert 5.0 < b["max"] <= 7.0  # at most floor(15.8k / 2048) = 7, the paper's 7.00; less while filling


def test_fig13_alpaca_at_its_rate_max_is_memory_bound_and_the_rest_keep_the_order():
    reqs = concurrency.workload("alpaca", 300, concurrency.PAPER_RATES["alpaca"], seed=0)
    b = concurrency.mean_batches(reqs, _budget())
    assert b["max"] < b["pow2"] <= b["oracle"] <= b["paged"]


def test_memory_bound_concurrency_grows_with_memory_for_every_system():
    slots = _budget()
    for lengths, n in (("sharegpt", 80), ("alpaca", 300)):
        reqs = [replace(r, arrival_s=0.0) for r in concurrency.workload(lengths, n, 1.0, seed=0)]
        by_share = [concurrency.mean_batches(reqs, int(slots * f) // BLOCK * BLOCK, queued_only=True)
                    for f in (0.25, 0.5, 1.0)]
        for system in concurrency.SYSTEMS:
            series = [b[system] for b in by_share]
            assert series[0] < series[1] < series[2], (lengths, system, series)
        assert by_share[-1]["max"] < by_share[-1]["pow2"] < by_share[-1]["oracle"] < by_share[-1]["paged"]


def test_alpaca_block_size_sweep_is_memory_bound():
    row = block_size.sweep_point("alpaca", 16, 200, seed=0)
    assert row["preemptions"] > 0  # the KV, not the arrivals, limits the batch


def test_experiment_commands_run_whole_traces_unless_quick(tmp_path, monkeypatch):
    from kvpool.commands import sim as sim_cli
    from kvpool.sim.experiments import storage_vs_compute

    sizes = []

    def recording(name):
        def run(size, seed, out):
            sizes.append(size)
            return storage_vs_compute.run(size, seed, out)
        return run

    monkeypatch.setattr(sim_cli, "get_experiment", recording)
    assert main(["sim", "storage-vs-compute", "--quick", "--out", str(tmp_path)]) == 0
    assert main(["sim", "storage-vs-compute", "--out", str(tmp_path)]) == 0
    assert sizes == ["small", "full"]
    doc = json.loads((tmp_path / "storage_vs_compute.json").read_text())
    assert doc["published"]  # every experiment names what it is compared against
