"""Retention in the simulator (issue 32 item 1): a request's retention goes through the same
scheduler into the same RetentionTable, TTLs expire against the virtual clock, and the
instances' KV events carry it into the conductor's index."""

import json

from kvpool.cli import main
from kvpool.conductor.records import ConductorConfig
from kvpool.core.retention import RetentionRequest
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.cluster import ClusterConfig, SimCluster
from kvpool.sim.experiments import retention as exp
from kvpool.sim.experiments.base import roofline

N = 40  # 10 system-prompt requests among 30 one-off prompts that flush an unretained cache


def test_a_pinned_system_prompt_keeps_its_hits_under_pressure_where_unpinned_loses_them():
    none = exp.retention_run("none", None, N, 0)
    pin = exp.retention_run("pin", RetentionRequest(exp.SYSTEM, None, 50), N, 0)
    assert none["system_hit_rate"] == 0.0 and none["pinned_mib"] == 0.0
    assert pin["system_hit_rate"] > 0.8
    assert pin["system_ttft_mean_s"] < none["system_ttft_mean_s"]
    assert pin["pinned_mib"] > 0 and pin["ttl_expiries"] == 0


def test_a_ttl_shorter_than_the_gap_expires_in_virtual_time_and_is_counted():
    short = exp.retention_run("ttl 1s", RetentionRequest(exp.SYSTEM, 1.0, 0), N, 0)
    long = exp.retention_run("ttl 60s", RetentionRequest(exp.SYSTEM, 60.0, 0), N, 0)
    assert short["ttl_expiries"] > 0 and short["system_hit_rate"] < 0.5
    assert long["ttl_expiries"] == 0 and long["system_hit_rate"] > 0.8


def test_the_cluster_conductor_learns_an_instances_retention_from_its_kv_events():
    cost, _ = roofline(exp.MODEL, exp.HARDWARE, block_size=exp.BLOCK)
    sched = SchedulerConfig(num_blocks=exp.NUM_BLOCKS, block_size=exp.BLOCK, max_num_batched_tokens=2048,
                            max_model_len=2048)
    sim = SimCluster(ClusterConfig(2, 0, sched, ConductorConfig(policy="cache-aware", block_size=exp.BLOCK)), cost)
    sim.run(exp.workload(8, RetentionRequest(exp.SYSTEM, None, 0)))
    index = sim.conductor.index
    system = sim.instances["p0"].hasher.hashes(((exp.SYNTHETIC_CHUNK_BASE, exp.SYSTEM),))
    held = index.retained_match(system, 1e9)  # a pin: live at any time
    assert list(held.values()) == [exp.SYSTEM // exp.BLOCK]


def test_sim_run_takes_a_retention_and_reports_its_counters(tmp_path):
    out = tmp_path / "run"
    assert main(["sim", "run", "--num-requests", "20", "--rate", "2", "--retain-prefix-tokens", "64",
                 "--retain-ttl", "5", "--retain-priority", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["ttl_expiries"] > 0 and {"pinned_mib", "pinned_evictions"} <= set(summary)
    assert main(["sim", "run", "--retain-ttl", "5", "--out", str(out)]) != 0  # needs a prefix
