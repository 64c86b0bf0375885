"""`kvpool` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvpool.commands.flag_help import FLAG_HELP
from kvpool.commands.flag_hints import chosen_parser, unknown_flag_message
from kvpool.errors import KVPoolError

# subcommand -> (module providing add_arguments(parser) and main(args), help)
COMMANDS = {
    "generate": ("kvpool.commands.generate", "generate text for one or more prompts"),
    "chat": ("kvpool.commands.chat", "interactive chat with the model"),
    "demo": ("kvpool.commands.demo", "show the paging mechanism at work (demo paging)"),
    "bench": ("kvpool.commands.bench", "benchmarks: core | throughput | long-context | serve | profile | overhead | kvstore | cluster"),
    "serve": ("kvpool.serve.cli", "OpenAI-compatible HTTP server"),
    "conductor": ("kvpool.cluster.cli", "the cluster's KV-aware gateway"),
    "cluster": ("kvpool.commands.cluster", "start/stop a local prefill/decode cluster: cluster up | down"),
    "sim": ("kvpool.commands.sim", "the cluster simulator and its experiments"),
    "kv": ("kvpool.store.cli", "KV storage tools: kv calc"),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help, unless its text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is argparse.SUPPRESS or default is False \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.upper()


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations, whose unknown flags are reported by the subcommand that
    was given them, with the nearest known flag or the kvpool equivalent of a vLLM flag."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = chosen_parser(self, parsed)
            chosen.error(unknown_flag_message(chosen, extras))
        return parsed


def _subparsers(parser: argparse.ArgumentParser):
    """Every parser below `parser`, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):
                yield sp
                yield from _subparsers(sp)


def _finish(parser: argparse.ArgumentParser) -> None:
    """Global flags accepted after any subcommand, help text for every flag, defaults shown."""
    for p in [parser, *_subparsers(parser)]:
        p.formatter_class = HelpFormatter
        p.allow_abbrev = False  # `--enable-prefix-cachin` is a typo, not a flag
        for action in p._actions:
            if action.help is None and action.dest in FLAG_HELP:
                action.help = FLAG_HELP[action.dest]
        if p is not parser:
            p.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                           help="logging level (also accepted before the subcommand)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with `only`, just that subcommand's module is imported (the others keep
    their name and help), so a bad flag fails before torch or a model is loaded."""
    parser = Parser(prog="kvpool", description="A KV-cache-centric LLM serving system.")
    parser.add_argument("--log-level", type=_log_level, default="INFO", help=f"logging level: {' | '.join(LOG_LEVELS)}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("kvpool"):
                raise
            p.set_defaults(_missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    _finish(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    args = build_parser(command).parse_args(argv)
    level = args.log_level
    if getattr(args, "quiet_by_default", False) and not args.verbose and "--log-level" not in argv:
        level = "WARNING"  # an interactive command shows its prompt, not the engine's start-up
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
