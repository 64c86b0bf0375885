"""`kvpool kv calc`: when does loading a cached prefix beat recomputing it?"""

from __future__ import annotations

import json
from dataclasses import asdict

from kvpool.costs.kv_calc import (
    DEFAULT_CONTEXTS,
    break_even_table,
    format_break_even,
    format_table,
    kv_calc_table,
)
from kvpool.costs.presets import HARDWARE, MODELS, get_hardware, get_model


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="kv_command", required=True)
    calc = sub.add_parser("calc", help="per-prefix KV bytes vs recompute FLOPs, and read time per tier")
    calc.add_argument("--model", action="append", default=None,
                      help=f"model preset, repeatable (default: llama2-70b and opt-13b); one of {sorted(MODELS)}")
    calc.add_argument("--hardware", default="a100-80gb", help=f"one of {sorted(HARDWARE)}")
    calc.add_argument("--context", type=int, action="append", default=None, help="prefix lengths in tokens")
    calc.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOPs a prefill reaches")
    calc.add_argument("--block-size", type=int, default=16, help="tokens per KV block (one read each)")
    calc.add_argument("--json", default=None, help="also write the rows as JSON here")


def main(args) -> int:
    hardware = get_hardware(args.hardware)
    rows, plans = [], []
    for name in args.model or ["llama2-70b", "opt-13b"]:
        rows += kv_calc_table(get_model(name), hardware, args.context or DEFAULT_CONTEXTS, args.mfu)
        plans += break_even_table(get_model(name), hardware, args.context or DEFAULT_CONTEXTS, args.mfu,
                                  args.block_size)
    print(format_table(rows))
    print("x host / x disk / x net: recompute time over read time; above 1, storing beats recomputing.")
    print()
    print(format_break_even(plans))
    print("loads: blocks the load-or-recompute planner (the engine's) reads of the prefix, one read per block; "
          "break-even: the tier bandwidth below which it recomputes some.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "break_even": [asdict(r) for r in plans]}, f, indent=2,
                      sort_keys=True)
    return 0
