"""The CLI fails fast and clearly on bad flags (before torch or a model loads), takes global
flags anywhere, and documents every flag with its default."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from kvpool.cli import build_parser, main


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *argv], capture_output=True, text=True, timeout=120)


def assert_clean_failure(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize(("flags", "words"), [
    (["--kv-cache-memory", "lots"], ["kv_cache_memory", "'lots'"]),
    (["--eviction-policy", "foo"], ["eviction_policy", "'foo'", "lru"]),
    (["--block-size", "0"], ["block_size", ">= 1"]),
    (["--max-num-seqs", "0"], ["max_num_seqs"]),
    (["--watermark", "1.5"], ["watermark"]),
    (["--swap-space", "big"], ["swap_space"]),
    (["--preemption-mode", "pause"], ["preemption_mode"]),
    (["--kv-remote", "http://x"], ["kv_remote"]),
])
def test_bad_engine_values_are_one_line_errors_before_loading(capsys, flags, words):
    rc = main(["serve", *flags])
    assert_clean_failure(rc, capsys.readouterr().err, "kvpool serve: error:", *words)


def test_a_directory_without_config_json_is_refused_by_name(capsys, tmp_path):
    rc = main(["generate", "--model", str(tmp_path), "hello"])
    assert_clean_failure(rc, capsys.readouterr().err, str(tmp_path), "config.json")
    rc = main(["serve", "--model", str(tmp_path / "missing.gguf")])
    assert_clean_failure(rc, capsys.readouterr().err, "does not exist")


def test_a_port_in_use_fails_before_the_model_loads(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["serve", "--port", str(port)])
    assert_clean_failure(rc, capsys.readouterr().err, f"127.0.0.1:{port}")


def test_the_real_entry_point_fails_fast_without_importing_torch():
    out = run_cli("serve", "--log-level", "debug", "--block-size", "0")
    assert_clean_failure(out.returncode, out.stderr, "block_size")
    probe = subprocess.run([sys.executable, "-c", (
        "import sys; from kvpool.cli import main; rc = main(['serve', '--eviction-policy', 'foo']);"
        "print(rc, 'torch' in sys.modules)")], capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["2", "False"], probe.stderr


def test_log_level_is_accepted_before_and_after_the_subcommand():
    assert build_parser("serve").parse_args(["--log-level", "debug", "serve"]).log_level == "DEBUG"
    assert build_parser("serve").parse_args(["serve", "--log-level", "warning"]).log_level == "WARNING"
    assert build_parser("bench").parse_args(["bench", "serve", "--log-level", "error"]).log_level == "ERROR"
    assert build_parser("serve").parse_args(["serve"]).log_level == "INFO"
    with pytest.raises(SystemExit) as e:
        build_parser("serve").parse_args(["serve", "--log-level", "loud"])
    assert e.value.code == 2


def _actions(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield from _actions(sp, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_of_every_command_has_help():
    missing = [f"{path} {a.option_strings or a.dest}" for path, a in _actions(build_parser(), "kvpool") if not a.help]
    assert not missing, missing


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens per KV block (default: 16)" in text
    assert "(default: lru)" in text
    assert "(default: 8000)" in text


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                yield from _parsers(sp)


def test_no_parser_accepts_abbreviated_flags():
    assert all(not p.allow_abbrev for p in _parsers(build_parser()))


def _error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_an_abbreviated_or_misspelt_flag_names_the_flag_it_resembles(capsys):
    assert _error(capsys, "serve", "--enable-prefix-cachin").endswith(
        "unknown flag --enable-prefix-cachin: did you mean --enable-prefix-caching?")
    assert _error(capsys, "bench", "serve", "--num-prompt", "3") == \
        "kvpool bench serve: error: unknown flag --num-prompt: did you mean --num-prompts?"


@pytest.mark.parametrize(("flag", "words"), [
    ("--gpu-memory-utilization", "--kv-cache-memory FRACTION"),
    ("--tensor-parallel-size", "tensor parallelism is not supported"),
    ("--trust-remote-code", "no remote code"),
])
def test_a_vllm_flag_names_its_kvpool_equivalent_or_why_there_is_none(capsys, flag, words):
    line = _error(capsys, "serve", flag, "2")
    assert line.startswith(f"kvpool serve: error: unknown flag {flag}: ") and words in line
    assert "unexpected argument" not in line  # the value belongs to the flag


def test_chat_shows_no_info_lines_before_its_prompt_unless_verbose():
    args = ["chat", "--dtype", "float32", "--num-blocks", "32", "--max-model-len", "256"]
    quiet = subprocess.run([sys.executable, "-m", "kvpool.cli", *args], input="", capture_output=True, text=True,
                           timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr and "kvpool chat" in quiet.stderr
    verbose = subprocess.run([sys.executable, "-m", "kvpool.cli", *args, "-v"], input="", capture_output=True,
                             text=True, timeout=300)
    assert verbose.returncode == 0 and " INFO " in verbose.stderr
