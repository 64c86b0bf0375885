"""The simulator runs a sliding-window model through the same KV manager: with SWA freeing its
decode batches grow past what the same memory holds when every block is kept."""

from __future__ import annotations

from kvpool.core.kv_manager import KVCacheManager
from kvpool.costs.presets import get_model
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import roofline
from kvpool.sim.instance import SimInstance, run_instance
from kvpool.sim.sim_store import SimStore
from kvpool.sim.workloads import SimRequest

BLOCK = 16


def _run(swa_freeing: bool):
    cost, blocks = roofline("gemma3-12b", "a100-40gb", 1, BLOCK)
    groups = get_model("gemma3-12b").layer_groups(swa_freeing)
    cfg = SchedulerConfig(num_blocks=blocks * groups.num_groups, block_size=BLOCK, max_num_batched_tokens=8192,
                          max_model_len=32768, kv_group_windows=groups.windows, enable_prefix_caching=False)
    reqs = [SimRequest(f"r{i}", 0.0, 16000, 64, ((i, 16000),), 10_000 + i) for i in range(24)]
    peak = [0]
    run = run_instance(reqs, cfg, cost, on_step=lambda inst, now, res: peak.__setitem__(0, max(peak[0], res.batch_size)))
    assert all(m.done for m in run.metrics)
    return peak[0], run


def test_swa_freeing_lets_a_windowed_model_batch_more_long_sequences():
    kept, kept_run = _run(False)
    freed, freed_run = _run(True)
    assert get_model("gemma3-12b").layer_groups().num_groups == 6
    assert freed > kept
    assert freed_run.end_s < kept_run.end_s


def test_a_windowed_sim_loads_each_groups_store_blocks_through_the_schedulers_kv_loads():
    """A store hit on a layer-grouped model, as the engine takes it: every full group loads the
    whole hit, every window group only the blocks its window reads before the hit point; the
    request then computes only its last tokens, and afterwards the device holds only cache."""
    groups = get_model("gemma3-12b").layer_groups()
    G = groups.num_groups
    cost, blocks = roofline("gemma3-12b", "a100-40gb", 1, BLOCK)
    cfg = SchedulerConfig(num_blocks=blocks * G, block_size=BLOCK, max_num_batched_tokens=8192,
                          max_model_len=32768, kv_group_windows=groups.windows)
    store = SimStore(KVCacheManager(4096, BLOCK), plan=False)  # the whole hit, whatever it costs
    inst = SimInstance("i0", cfg, cost, store=store)
    req = SimRequest("r0", 0.0, 4000, 8, ((7, 4000),), 1 << 41)
    hashes = inst.hashes_for(req)
    assert store.put(hashes, G) == G * len(hashes)
    m = inst.add(req, 0.0)
    now = 0.0
    while inst.has_work():
        now += inst.step(now).duration
    hit = (4000 - 1) // BLOCK
    window = next(w for w in groups.windows if w is not None)
    full = groups.windows.count(None)
    assert inst.sched.num_external_hit_tokens == m.cached_tokens == hit * BLOCK
    assert inst.counters.loaded_blocks == full * hit + (G - full) * -(-(window - 1) // BLOCK)
    assert inst.counters.prefill_tokens == 4000 - hit * BLOCK
    usage = inst.sched.kv.usage()
    assert not inst.sched.kv.seqs and usage.free_blocks == usage.total_blocks
