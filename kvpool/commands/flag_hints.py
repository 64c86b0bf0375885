"""What to say about a flag the command does not know: the nearest flag it does know, or, for
the vLLM flags people bring along, kvpool's equivalent (or why there is none)."""

from __future__ import annotations

import argparse
import difflib

# vLLM's flag -> what kvpool offers instead
VLLM_FLAGS = {
    "--gpu-memory-utilization": "use --kv-cache-memory FRACTION (the fraction of free device memory, e.g. 0.3, "
                                "or a size such as 4GiB, for the KV cache)",
    "--tensor-parallel-size": "kvpool runs each instance on one device: tensor parallelism is not supported "
                              "(several instances behind `kvpool conductor` scale out instead)",
    "-tp": "kvpool runs each instance on one device: tensor parallelism is not supported",
    "--pipeline-parallel-size": "kvpool runs each instance on one device: pipeline parallelism is not supported",
    "--data-parallel-size": "run several `kvpool serve` instances behind `kvpool conductor` instead",
    "--trust-remote-code": "kvpool loads its own model code only (Llama-family, Qwen2, Mistral, Gemma-3 ...): "
                           "there is no remote code to trust",
    "--enforce-eager": "not needed: kvpool captures no CUDA graphs",
    "--disable-log-requests": "not needed: kvpool does not log requests",
    "--disable-log-stats": "not needed: kvpool logs no periodic stats (see /metrics)",
    "--tokenizer": "kvpool reads the tokenizer from --model (its directory or GGUF file)",
    "--download-dir": "kvpool downloads nothing: give --model a local directory or GGUF file",
    "--cpu-offload-gb": "use --kv-host-memory for a host tier of the KV cache; weights stay on the device",
    "--kv-transfer-config": "use --kv-remote (redis:// or mooncake://) for a shared KV pool",
    "--speculative-config": "speculative decoding is not supported",
    "--structured-outputs-config.disable_any_whitespace": "send \"structured_outputs\": "
                                                          "{\"disable_any_whitespace\": true} per request",
}


def unknown_flag_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """One line naming each unknown argument with its hint."""
    known = [o for a in parser._actions for o in a.option_strings]
    parts = []
    after_flag = False
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-"):
            if not after_flag:  # otherwise the unknown flag's value
                parts.append(f"unexpected argument {arg[:64]!r}")
            after_flag = False
            continue
        after_flag = "=" not in arg
        hint = VLLM_FLAGS.get(flag)
        if hint is None:
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "see --help"
        parts.append(f"unknown flag {flag}: {hint}")
    return "; ".join(parts)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser the arguments selected (`kvpool bench serve` -> its own)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, sub.dest, None) if sub is not None else None
        if name is None or name not in sub.choices:
            return parser
        parser = sub.choices[name]
