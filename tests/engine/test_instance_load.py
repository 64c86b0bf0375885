"""A real decode instance (the engine behind `kvpool serve --role decode`) and a simulated one
report the same load and accept or refuse the same requests when their schedulers hold the
same state: both call the core's functions (kvpool/sched/instance_load.py)."""

from __future__ import annotations

from dataclasses import asdict, fields

from kvpool.bench.validate import sim_requests
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.sched.instance_load import InstanceLoad, decode_accepts
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sim.instance import SimInstance

OUTPUT = 12


class FixedCost:
    """Step times do not matter here: only the scheduler's state is compared."""

    def step_time(self, batch) -> float:
        return 0.01

    def kv_transfer_time(self, num_blocks: int) -> float:
        return 0.0


def test_real_and_simulated_decode_instances_report_and_admit_alike(loaded):
    engine = Engine(EngineConfig(num_blocks=40, block_size=16, max_num_batched_tokens=256), loaded=loaded)
    sim = SimInstance("d0", engine.scheduler.config, FixedCost())
    prompts = [[1000 + 50 * i + j for j in range(n)] for i, n in enumerate((70, 130, 90, 200, 40))]
    for p, r in zip(prompts, sim_requests(prompts, OUTPUT, [0.0] * len(prompts)), strict=True):
        engine.add_request(p, SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True))
        sim.add(r, 0.0)
    seen = set()
    for step in range(6):
        report = engine.load_report()
        real = InstanceLoad(**{f.name: report[f.name] for f in fields(InstanceLoad)})
        assert real == sim.load(), f"step {step}"
        for prompt_len in (16, 100, 300, 600):
            for output_len in (1, 64, 200):
                accepts = engine.decode_accepts(prompt_len, output_len)
                assert accepts == decode_accepts(sim.sched, prompt_len, output_len), (step, prompt_len, output_len)
                seen.add(accepts)
        engine.step()
        sim.step(step * 0.01)
    assert seen == {True, False}  # the states above exercise both answers
    assert asdict(sim.load()).keys() <= engine.load_report().keys()
