"""`kvpool bench core | throughput | long-context | serve | profile | overhead | kvstore | kv-accuracy | cluster | swa | determinism`."""

from __future__ import annotations

import importlib

BENCHES = {
    "core": "kvpool.bench.core_cli",
    "throughput": "kvpool.bench.throughput",
    "long-context": "kvpool.bench.long_context",
    "serve": "kvpool.bench.serve",
    "profile": "kvpool.bench.profile",
    "overhead": "kvpool.bench.overhead",
    "kvstore": "kvpool.bench.kvstore",
    "kv-accuracy": "kvpool.bench.kv_accuracy",
    "cluster": "kvpool.bench.cluster",
    "swa": "kvpool.bench.swa",
    "determinism": "kvpool.bench.determinism",
}


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, module in BENCHES.items():
        sp = sub.add_parser(name)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:  # one bench's missing dependency must not take the others down
            sp.set_defaults(_bench_missing=e.name or str(e))
            continue
        mod.add_arguments(sp)
        sp.set_defaults(_bench_main=mod.main)


def main(args) -> int:
    if not hasattr(args, "_bench_main"):
        print(f"kvpool bench {args.bench}: needs the module {args._bench_missing!r}, which is not installed")
        return 2
    return args._bench_main(args)
