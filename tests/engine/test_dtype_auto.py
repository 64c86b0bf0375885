"""`--dtype auto`: bf16 where the CPU has a bf16 matmul unit, fp32 elsewhere, said in the log."""

from __future__ import annotations

import logging

import pytest

from kvpool.engine import config
from kvpool.engine.config import EngineConfig
from kvpool.errors import ConfigError


@pytest.mark.parametrize(
    "flags,expected",
    [(("amx_bf16", "avx512_bf16"), "bfloat16"), (("avx512_bf16",), "bfloat16"), ((), "float32")],
)
def test_auto_picks_bf16_only_on_cpus_with_bf16_units(monkeypatch, caplog, flags, expected):
    monkeypatch.setattr(config, "cpu_bf16_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="kvpool.engine.config"):
        assert EngineConfig(device="cpu").dtype == expected
    assert f"dtype auto -> {expected}" in caplog.text
    if flags:
        assert flags[0] in caplog.text


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_cuda_is_bf16_where_the_gpu_has_it(monkeypatch, bf16, expected):
    monkeypatch.setattr(config, "cpu_bf16_flags", lambda: ())  # the host's CPU does not decide
    monkeypatch.setattr(config, "_cuda_bf16", lambda: bf16)
    assert EngineConfig(device="cuda").dtype == expected


def test_explicit_dtypes_are_kept_and_bad_ones_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert EngineConfig(device="cpu", dtype="float32").dtype == "float32"
    with pytest.raises(ConfigError, match="float64"):
        EngineConfig(dtype="float64")
