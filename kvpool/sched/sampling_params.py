"""Per-request generation parameters, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from kvpool.errors import InvalidRequest

MAX_N = 16
MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds


@dataclass(slots=True)
class SamplingParams:
    """What to generate and how to pick tokens. temperature 0 means greedy."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from user input, naming any unknown parameter."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**values)

    def validate(self) -> None:
        """Every type and range check of a request's parameters, before it touches any state:
        exact types (a bool is not an integer), finite numbers, seeds whose every sample's
        generator seed (`seed + sample_index`) fits in 64 bits."""

        def bad(param: str, message: str) -> InvalidRequest:
            return InvalidRequest(f"{param} {message}", param=param)

        for name in ("n", "max_tokens", "min_tokens", "top_k"):
            v = getattr(self, name)
            if not _is_int(v):
                raise bad(name, f"must be an integer, got {v!r}")
        for name in ("temperature", "top_p", "min_p", "length_penalty"):
            v = getattr(self, name)
            if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "use_beam_search"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise bad(name, f"must be true or false, got {v!r}")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in 1..{MAX_N}, got {self.n}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            if not _is_int(self.seed):
                raise bad("seed", f"must be an integer, got {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED - (self.n - 1):
                raise bad("seed", f"must be in 0..{MAX_SEED - (self.n - 1)} (sample i uses seed + i, "
                                  f"below 2**64) for n={self.n}, got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be a list of non-negative token ids, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in 0..20, got {self.logprobs!r}")
        if self.use_beam_search and self.n < 2:
            raise bad("n", "beam search needs n >= 2 beams")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the model can produce: raises when a stop token id is outside the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequest(f"stop_token_ids: {t} is not a token id (the vocabulary has {vocab_size})",
                                     param="stop_token_ids")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
