"""What the engine tests share: an engine over a session-loaded model, a batch run to
completion, and the check that a finished engine holds no block."""

from __future__ import annotations

from typing import Any

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import run_to_completion


def make_engine(loaded: Any, **config: Any) -> Engine:
    """`config` as EngineConfig's fields; float32 unless it says otherwise (the session's
    `loaded` model is float32, so the engine runs it as loaded)."""
    return Engine(EngineConfig(**{"dtype": "float32", **config}), loaded=loaded)


def run_all(engine: Engine, prompts, params) -> list:
    return run_to_completion(engine, prompts, params)


def assert_no_leak(engine: Engine) -> None:
    kv = engine.scheduler.kv
    assert not kv.seqs
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
