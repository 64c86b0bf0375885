"""`kvpool sim`: a single configurable run, one experiment, the whole report, or the scale run."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvpool.core.retention import RetentionRequest
from kvpool.costs.presets import get_model
from kvpool.errors import ConfigError
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim import replay
from kvpool.sim.cluster import SimCluster, gc_paused
from kvpool.sim.experiments import EXPERIMENTS, get_experiment
from kvpool.sim.experiments.base import roofline
from kvpool.sim.instance import run_instance
from kvpool.sim.metrics import flat_row, format_table, retention_summary, summarize, write_json
from kvpool.sim.plots import plot_cdf
from kvpool.sim.report import write_report
from kvpool.sim.traces import TraceOptions, load_mooncake_trace
from kvpool.sim.workloads import SimRequest, WorkloadSpec, synthetic_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", required=True)
    r = sub.add_parser("run", help="one configurable simulation on a single instance")
    r.add_argument("--model", default="opt-13b")
    r.add_argument("--hardware", default="a100-40gb")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--workload", default="sharegpt", help="sharegpt | alpaca | mooncake:conversation")
    r.add_argument("--num-requests", type=int, default=500)
    r.add_argument("--rate", type=float, default=1.0, help="requests/s (inf = all at t=0)")
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--preemption-mode", default="recompute", choices=("recompute", "swap"))
    r.add_argument("--no-prefix-caching", action="store_true")
    r.add_argument("--no-swa-freeing", action="store_true",
                   help="sliding-window layers keep every KV block (as full attention does)")
    r.add_argument("--retain-prefix-tokens", type=int, default=None, metavar="N",
                   help="every request retains its prompt's first N tokens' full blocks (kvpool_retention)")
    r.add_argument("--retain-ttl", type=float, default=None, metavar="S",
                   help="the retention's TTL in virtual seconds from arrival (default: pinned for the run)")
    r.add_argument("--retain-priority", type=int, default=None, metavar="P", help="the retention's priority (0..100)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=Path("sim-out"))
    for name in EXPERIMENTS:
        e = sub.add_parser(name, help=f"experiment {name}")
        _common(e)
    rep = sub.add_parser("report", help="run every experiment and write a Markdown report")
    _common(rep)
    sc = sub.add_parser("scale", help="the whole conversation trace through a 16-instance P/D cluster")
    sc.add_argument("--max-requests", type=int, default=None)
    sc.add_argument("--repeat", type=int, default=1,
                    help="run the trace this many times in a row, each copy with its own blocks (a k times longer run)")
    sc.add_argument("--out", type=Path, default=Path("sim-out"))
    from kvpool.bench import validate  # the engine (torch) only loads for this subcommand's run

    validate.add_arguments(sub.add_parser("validate", help="the simulator against the real engine on this machine"))
    replay.add_arguments(sub.add_parser("replay", help="a server's request log (serve --record-requests) "
                                        "through the simulator, beside its recorded hit rate and TTFT"))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="reduced sizes and trace windows (CI); by default whole traces and full sizes (slow)")
    p.add_argument("--out", type=Path, default=Path("sim-out"))
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    cmd = args.sim_command
    if cmd == "run":
        return _run(args)
    if cmd == "report":
        path = write_report(args.out, "small" if args.quick else "full", args.seed)
        print(f"report written to {path}")
        return 0
    if cmd == "scale":
        return _scale(args)
    if cmd == "replay":
        return replay.main(args)
    if cmd == "validate":
        from kvpool.bench import validate

        return validate.main(args)
    res = get_experiment(cmd)("small" if args.quick else "full", args.seed, args.out)
    res.write_json(args.out)
    print(res.table())
    for p in res.plots:
        print(f"figure: {p}")
    return 0


def _run(args: argparse.Namespace) -> int:
    cost, blocks = roofline(args.model, args.hardware, args.tp, args.block_size)
    if args.workload.startswith("mooncake:"):
        reqs = load_mooncake_trace(args.workload.split(":", 1)[1], TraceOptions(max_requests=args.num_requests))
        max_len = max(r.prompt_len + r.output_len for r in reqs)
    elif args.workload in ("sharegpt", "alpaca"):
        max_len = args.max_model_len
        reqs = synthetic_workload(WorkloadSpec(num_requests=args.num_requests, rate=args.rate,
                                               lengths=args.workload, max_len=max_len, seed=args.seed))
    else:
        raise ConfigError(f"unknown workload {args.workload!r}: sharegpt | alpaca | mooncake:<trace>")
    reqs = _retained(reqs, args)
    groups = get_model(args.model).layer_groups(not args.no_swa_freeing)
    blocks *= groups.num_groups  # a pool block holds one layer group: the same memory, G times the blocks
    cfg = SchedulerConfig(
        kv_group_windows=groups.windows, num_blocks=blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, 1), max_model_len=max(max_len, 2),
        enable_prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode,
        num_host_blocks=blocks if args.preemption_mode == "swap" else 0, namespace=args.model,
    )
    run = run_instance(reqs, cfg, cost)
    summary = summarize(run.metrics)
    summary["preemptions"] = run.instance.sched.num_preemptions
    if args.retain_prefix_tokens is not None:  # a pool block holds one layer group's share of a block's KV
        per_block = args.block_size * get_model(args.model).kv_bytes_per_token() // groups.num_groups
        summary.update(retention_summary(run.instance.sched.kv.pool, per_block))
    print(format_table([flat_row(args.workload, summary)]))
    write_json(args.out / "run.json", {"args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
                                       "summary": summary})
    plot_cdf({"TTFT": [m.ttft for m in run.metrics if m.done]}, args.out / "run_ttft.png", "TTFT (s)")
    print(f"wrote {args.out / 'run.json'} and {args.out / 'run_ttft.png'}")
    return 0


def _retained(reqs: list[SimRequest], args: argparse.Namespace) -> list[SimRequest]:
    """The workload with `--retain-*`'s retention on every request (none without the flags)."""
    if args.retain_prefix_tokens is None:
        if args.retain_ttl is not None or args.retain_priority is not None:
            raise ConfigError("--retain-ttl and --retain-priority need --retain-prefix-tokens")
        return reqs
    ask = (RetentionRequest(args.retain_prefix_tokens, args.retain_ttl, args.retain_priority or 0),)
    return [replace(r, retention=ask) for r in reqs]


def scale_run(max_requests: int | None = None, repeat: int = 1) -> dict:
    """The conversation trace at full lengths through 8 prefill + 8 decode instances
    (LLaMA2-70B, 8 A800s each, kv-centric routing, prefix caching on), `repeat` times in a row."""
    from kvpool.sim.experiments.conductor_policies import cluster_config

    cost, blocks = roofline("llama2-70b", "a800-80gb", tp=8, block_size=16)
    reqs = load_mooncake_trace("conversation", TraceOptions(max_requests=max_requests, repeat=repeat))
    cluster = SimCluster(cluster_config("kv-centric", 2.0, False, 8, blocks, 0), cost)
    start = time.perf_counter()
    with tqdm(total=len(reqs), desc="scale", unit="req") as bar:
        res = cluster.run(reqs, on_arrival=bar.update)
    wall = time.perf_counter() - start
    s = summarize(res.metrics)
    return {"requests": len(reqs), "wall_s": wall, "simulated_requests_per_s": len(reqs) / wall,
            "virtual_s": res.end_s, "completed": s["completed"], "rejected": s["rejected"],
            "prefix_hit_rate": s["prefix_hit_rate"], "ttft_mean_s": s["ttft_s"]["mean"]}


def _scale(args: argparse.Namespace) -> int:
    # Paused until the run's objects are gone: right after the run, summarising it would set off
    # a full collection over its millions of objects.
    with gc_paused():
        out = scale_run(args.max_requests, args.repeat)
    write_json(args.out / "scale.json", out)
    print(format_table([out]))
    return 0

