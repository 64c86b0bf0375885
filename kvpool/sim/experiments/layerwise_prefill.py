"""Experiment 14: layer-wise prefill overlap (lecture §9.3) — TTFT of an 8.7K-token prompt with
half its KV in the pool, when that KV lands whole before the forward vs layer by layer while the
forward computes.

It runs the engine's own decision code: the real `Scheduler` admits the prompt with the store
holding its first half (a `KVLoad`), the landed blocks are reported (`finish_kv_load`), and
`plan_layerwise` makes the plan the engine's loader writes; the roofline cost model prices each
layer's transfer and compute, and `overlap_timeline` is the recurrence the loader's per-layer
events give: layer l computes once layer l has landed and layer l-1 has computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.costs.cost_model import RooflineCostModel
from kvpool.costs.presets import get_hardware, get_model
from kvpool.sched.layerwise import LayerwisePlan, overlap_timeline, plan_layerwise, whole_block_time
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig
from kvpool.sim.experiments.base import ExperimentResult, check_size
from kvpool.sim.plots import plot_grouped_bars

PROMPT = 8704  # the lecture's ~8.7K tokens: 544 blocks of 16
BLOCK = 16
HEADLINE = ("llama2-7b", "a800-80gb", "disk")
MODELS = (("llama2-7b", "a800-80gb", 1), ("llama2-13b", "a800-80gb", 1), ("llama2-70b", "a800-80gb", 8))
LINKS = ("host", "remote", "disk")  # PCIe from host DRAM, one RDMA NIC, one NVMe SSD
PUBLISHED_MS = (870.0, 454.0)  # lecture §9.3: whole-block -> layer-wise


@dataclass(slots=True, frozen=True)
class PrefillCase:
    """What the scheduler decided for the prompt: the load plan and the step that follows it."""

    plan: LayerwisePlan
    new_tokens: int
    context_len: int


def plan_case(prompt_len: int, cached_fraction: float, num_layers: int, landed_fraction: float = 1.0) -> PrefillCase:
    """Admit one prompt whose first `cached_fraction` of blocks the store holds, report that the
    first `landed_fraction` of them read back whole, and return the plan and the step it leaves."""
    sched = Scheduler(SchedulerConfig(num_blocks=prompt_len // BLOCK + 8, block_size=BLOCK,
                                      max_num_batched_tokens=prompt_len, max_model_len=prompt_len + 1))
    held = int(prompt_len // BLOCK * cached_fraction)
    sched.external_kv = lambda hashes: min(held, len(hashes))
    seq = sched.new_sequence(list(range(prompt_len)))
    sched.add_request(SequenceGroup("prompt", [seq], SamplingParams(max_tokens=1), 0.0))
    (load,) = sched.schedule().kv_loads
    landed = int(len(load.block_ids) * landed_fraction)
    sched.finish_kv_load(load, landed)
    plan = plan_layerwise([load], [landed], num_layers)
    (step,) = sched.schedule().scheduled
    return PrefillCase(plan, step.num_new_tokens, step.start + step.num_new_tokens)


def layer_costs(cost: RooflineCostModel, case: PrefillCase, link: str) -> tuple[list[float], list[float]]:
    """Per layer: seconds to move the plan's blocks of that layer over `link`, and to compute it."""
    tr = cost.transfers
    bandwidth, latency = {"host": (tr.pcie_bandwidth, tr.pcie_latency), "disk": (tr.disk_bandwidth, tr.disk_latency),
                          "remote": (tr.net_bandwidth, tr.net_latency)}[link]
    layers = case.plan.num_layers
    per_layer_bytes = case.plan.num_blocks * tr.block_bytes / layers
    transfer = [latency + per_layer_bytes / bandwidth] * layers
    compute = cost.compute_time([case.new_tokens], [case.context_len]) - cost.overhead_s
    return transfer, [compute / layers] * layers


def engine_ttft(cost: RooflineCostModel, case: PrefillCase, link: str) -> tuple[float, float]:
    """kvpool's engine, whole-block and layer-wise. Whole-block: the tier read and check (host
    DRAM, the SSD or the NIC) finish before the step, then the host->device write lands whole
    before the forward. Layer-wise: only the blocks' headers (their per-layer checksums) are read
    before the step; the loader reads, checks and writes layer l (tier read, then PCIe) while
    layer l-1 computes (docs/store.md, Layer-wise loading)."""
    nbytes = case.plan.num_blocks * cost.transfers.block_bytes
    layers = case.plan.num_layers
    if link == "host":
        reads = [nbytes / cost.hardware.host_dram_bandwidth / layers] * layers
    else:
        reads = layer_costs(cost, case, link)[0]
    pcie, compute = layer_costs(cost, case, "host")
    whole = sum(reads) + cost.overhead_s + whole_block_time(pcie, compute)
    per_layer = [r + p for r, p in zip(reads, pcie, strict=True)]
    return whole, cost.overhead_s + overlap_timeline(per_layer, compute).total_s


def ttft_row(model: str, hardware: str, tp: int, link: str) -> dict:
    cost = RooflineCostModel(get_model(model), get_hardware(hardware), tp=tp, block_size=BLOCK)
    case = plan_case(PROMPT, 0.5, cost.model.num_layers)
    transfer, compute = layer_costs(cost, case, link)
    whole = whole_block_time(transfer, compute) + cost.overhead_s
    layerwise = overlap_timeline(transfer, compute).total_s + cost.overhead_s
    return {"model": model, "hardware": f"{hardware} x{tp}", "link": link, "cached_tokens": case.plan.num_blocks * BLOCK,
            "transfer_ms": sum(transfer) * 1e3, "compute_ms": (sum(compute) + cost.overhead_s) * 1e3,
            "whole_block_ms": whole * 1e3, "layerwise_ms": layerwise * 1e3, "speedup": whole / layerwise,
            **dict(zip(("engine_whole_ms", "engine_layerwise_ms"), (t * 1e3 for t in engine_ttft(cost, case, link)),
                       strict=True)),
            "published": (f"{PUBLISHED_MS[0]:.0f} -> {PUBLISHED_MS[1]:.0f} ms (lecture §9.3)"
                          if (model, hardware, link) == HEADLINE else "")}


def run(size: str = "small", seed: int = 0, out: Path | None = None) -> ExperimentResult:
    check_size(size)  # analytical: the same at every size
    rows = [ttft_row(m, hw, tp, link) for m, hw, tp in MODELS for link in LINKS]
    head = next(r for r in rows if r["published"])
    plots = []
    if out is not None:
        labels = [f"{r['model'].removeprefix('llama2-')}\n{r['link']}" for r in rows]
        plots.append(plot_grouped_bars(labels, {"whole block": [r["whole_block_ms"] for r in rows],
                                                "layer-wise": [r["layerwise_ms"] for r in rows]},
                                       out / "layerwise_prefill.png", "TTFT (ms)",
                                       f"{PROMPT}-token prompt, half its KV in the pool (LLaMA2, A800)"))
    return ExperimentResult(
        "layerwise_prefill", "Layer-wise prefill overlap: TTFT with half the prompt's KV in the pool", rows,
        {"prompt_tokens": PROMPT, "block_size": BLOCK, "headline": list(HEADLINE), "seed_unused": seed}, plots,
        setup=(f"One {PROMPT}-token prompt whose first half ({PROMPT // 2} tokens) the KV pool holds, the rest "
               "computed in one step. The scheduler's own admission and load report decide the plan "
               "(kvpool/sched/layerwise.py, the code the engine's loader runs); the roofline prices each layer's "
               "compute (1/L of the step) and each layer's share of the loaded KV over the link: PCIe from host "
               "DRAM (host), one RDMA NIC (remote) or one NVMe SSD at 6 GB/s (disk). whole_block = all layers land, "
               "then the forward; layerwise = layer l computes once it has landed and layer l-1 is done; "
               "engine_whole / engine_layerwise = kvpool's engine: the tier read and check first, then the PCIe write "
               "whole (--no-kv-layerwise-load), or the headers first and each layer's tier read, check and PCIe "
               "write under the previous layer's compute (--kv-layerwise-load). Analytical."),
        finding=(f"Layer-wise loading hides the transfer under compute: TTFT falls from transfer + compute to about "
                 f"max(transfer, compute) + one layer. In the headline case ({head['model']}, {head['link']}) the "
                 f"transfer ({head['transfer_ms']:.0f} ms) and compute ({head['compute_ms']:.0f} ms) are comparable, "
                 f"so TTFT falls {head['whole_block_ms']:.0f} -> {head['layerwise_ms']:.0f} ms ({head['speedup']:.2f}x); "
                 "a fast link (PCIe, RDMA) or a big model makes the transfer small next to compute and the gain small. "
                 "The engine (engine_*) reads only the blocks' headers before the step and each layer's tier read, "
                 "check and host->device write under the previous layer's compute (per-layer checksums; a layer that "
                 "fails rewinds its sequence), so it pays the read and the write of a layer in series under compute: "
                 f"{head['engine_whole_ms']:.0f} -> {head['engine_layerwise_ms']:.0f} ms in the headline case."),
        columns=["model", "hardware", "link", "cached_tokens", "transfer_ms", "compute_ms", "whole_block_ms",
                 "layerwise_ms", "speedup", "engine_whole_ms", "engine_layerwise_ms", "published"],
        published=(f"Lecture §9.3: an 8.7K-token prompt with half its KV in the pool, {PUBLISHED_MS[0]:.0f} -> "
                   f"{PUBLISHED_MS[1]:.0f} ms (1.92x) when loading layer by layer overlaps compute (published column). "
                   "The lecture's model and link are not given with the figure; LLaMA2-7B on an A800 reading from one "
                   f"NVMe SSD is the preset pair whose transfer is about as long as compute, as in the lecture, and "
                   f"gives {head['whole_block_ms']:.0f} -> {head['layerwise_ms']:.0f} ms."),
    )
