"""What every route needs: the async engine, the tokenizer, the served name, the keys and the limits."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvpool.serve.async_engine import AsyncEngine
from kvpool.serve.auth import KeyRing
from kvpool.serve.front import check_model, default_max_tokens

if TYPE_CHECKING:
    from kvpool.engine.lora.adapters import AdapterSet

T = TypeVar("T")


def tokenizer_pool() -> ThreadPoolExecutor:
    """Tokenization and chat-template rendering run here, off the event loop, so a big prompt
    does not stall other clients (the tokenizer releases the GIL while it encodes)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-tokenize")


async def off_loop(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # kvpool.engine.tokenizer.Tokenizer
    model_name: str
    aliases: frozenset[str]  # other names accepted for the model (e.g. the engine's own id)
    max_model_len: int
    kv_capacity_tokens: int  # the whole device pool, in tokens
    vocab_size: int | None = None  # the model's (token ids must be below it); None: not checked here
    keys: KeyRing = field(default_factory=KeyRing)
    tool_call_parser: str | None = None  # `--tool-call-parser`: enables tool_choice "auto"
    served_names: tuple[str, ...] = ()  # every --served-model-name, the first being model_name
    lora: AdapterSet | None = None  # --enable-lora: the engine's adapters, each served under its name
    created: int = field(default_factory=lambda: int(time.time()))
    pool: ThreadPoolExecutor = field(default_factory=tokenizer_pool)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, None for the base model; 404 for a name not served."""
        if model and self.lora is not None and model in self.lora.adapters:
            return model
        check_model(model, self.model_name, self.aliases)
        return None

    def reported_model(self, model: str | None) -> str:
        """The id a response reports: the adapter's name for a LoRA request, else the model's."""
        return model if model and self.lora is not None and model in self.lora.adapters else self.model_name

    def default_max_tokens(self, prompt_len: int, n: int) -> int:
        return default_max_tokens(prompt_len, n, self.max_model_len, self.kv_capacity_tokens)

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await off_loop(self.pool, fn, *args, **kwargs)
