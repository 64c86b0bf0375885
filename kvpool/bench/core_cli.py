"""CLI glue for `kvpool bench core`."""

from kvpool.bench.core import run


def add_arguments(p) -> None:
    p.add_argument("--num-seqs", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)


def main(args) -> int:
    run(args.num_seqs, args.seed, args.json)
    return 0
