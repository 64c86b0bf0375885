"""What every route needs: the async engine, the tokenizer, the served name and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvpool.serve.async_engine import AsyncEngine
from kvpool.serve.errors import ModelNotFound


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # kvpool.engine.tokenizer.Tokenizer
    model_name: str
    aliases: frozenset[str]  # other names accepted for the model (e.g. the engine's own id)
    max_model_len: int
    kv_capacity_tokens: int  # the whole device pool, in tokens
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name and model not in self.aliases:
            raise ModelNotFound(f"model {model!r} does not exist; this server serves {self.model_name!r}",
                                param="model")

    def default_max_tokens(self, prompt_len: int, n: int) -> int:
        """The rest of the context: what fits in the model's window and in the KV pool for n samples."""
        room = min(self.max_model_len, self.kv_capacity_tokens // max(1, n)) - prompt_len
        return max(1, room)
