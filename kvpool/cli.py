"""`kvpool` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvpool.errors import KVPoolError

# subcommand -> (module providing add_arguments(parser) and main(args), help)
COMMANDS = {
    "generate": ("kvpool.commands.generate", "generate text for one or more prompts"),
    "chat": ("kvpool.commands.chat", "interactive chat with the model"),
    "demo": ("kvpool.commands.demo", "show the paging mechanism at work (demo paging)"),
    "bench": ("kvpool.commands.bench", "benchmarks: core | throughput | serve | profile | kvstore | cluster"),
    "serve": ("kvpool.serve.cli", "OpenAI-compatible HTTP server"),
    "conductor": ("kvpool.cluster.cli", "the cluster's KV-aware gateway"),
    "cluster": ("kvpool.commands.cluster", "start/stop a local prefill/decode cluster: cluster up | down"),
    "sim": ("kvpool.commands.sim", "the cluster simulator and its experiments"),
    "kv": ("kvpool.store.cli", "KV storage tools: kv calc"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="A KV-cache-centric LLM serving system.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("kvpool"):
                raise
            p.set_defaults(_missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "_missing", None):
        print(f"kvpool {args.command}: not available in this build ({args._missing} is missing)", file=sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except KVPoolError as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
