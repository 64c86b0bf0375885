"""Per-request generation parameters, validated in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from kvpool.core.retention import RetentionRequest
from kvpool.errors import InvalidRequest

MAX_N = 16
MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One output constraint (vLLM's `structured_outputs` / `guided_*`): exactly one field set.
    `json` is a JSON schema (dict or its JSON text); `grammar` is EBNF (GBNF) text."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's name: compact JSON (no whitespace between tokens) instead of xgrammar's default, any whitespace
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequest("structured disable_any_whitespace must be a boolean", param="disable_any_whitespace")
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequest(
                f"structured output needs exactly one of {', '.join(STRUCTURED_KINDS)}; got {set_ or 'none'}",
                param="structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequest("structured json must be a JSON schema object or its text", param="json")
        if self.json_object is not True and self.json_object is not False:
            raise InvalidRequest("structured json_object must be a boolean", param="json_object")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequest(f"structured {name} must be a non-empty string", param=name)
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequest("structured choice must be a non-empty list of non-empty strings", param="choice")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = field(default_factory=list)
    best_of: int | None = None  # sample best_of, return the n with the highest cumulative logprob
    prompt_logprobs: int | None = None  # logprobs of each prompt token (and its top-N) when set
    structured_outputs: StructuredOutputs | None = None
    lora: str | None = None  # the LoRA adapter's name (kvpool.engine.lora); None: the base model
    retention: tuple[RetentionRequest, ...] = ()  # keep prompt prefixes cached (core/retention.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _token_id_keys(self.logit_bias)
        if isinstance(self.retention, dict | RetentionRequest):
            self.retention = (self.retention,)
        if isinstance(self.retention, list | tuple):
            self.retention = tuple(RetentionRequest(**r) if isinstance(r, dict) else r for r in self.retention)
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from user input, naming any unknown parameter (vLLM's older `guided_decoding`
        is `structured_outputs`)."""
        if "guided_decoding" in values:
            values = {k: v for k, v in values.items() if k != "guided_decoding"} | {
                "structured_outputs": values["guided_decoding"]}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**values)

    @property
    def num_samples(self) -> int:
        """Sequences to sample: best_of when set, else n."""
        return self.best_of or self.n

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
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):  # 0: score the prompt only
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
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", f"must be an adapter's name, got {self.lora!r}")
        if not isinstance(self.retention, tuple) or not all(isinstance(r, RetentionRequest) for r in self.retention):
            raise bad("retention", "must be RetentionRequests or dicts of their fields")
        self._validate_controls(bad)

    def _validate_controls(self, bad) -> None:
        """Penalties, logit_bias, bad_words, best_of, prompt_logprobs and structured outputs."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v):
                raise bad(name, f"must be a finite number, got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None and not all(
            (_is_int(v) or isinstance(v, float)) and not math.isnan(v) for v in self.logit_bias.values()
        ):
            raise bad("logit_bias", "values must be numbers (clamped to [-100, 100])")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.best_of is not None:
            if not _is_int(self.best_of):
                raise bad("best_of", f"must be an integer, got {self.best_of!r}")
            if not self.n <= self.best_of <= MAX_N:
                raise bad("best_of", f"must be in n ({self.n})..{MAX_N}, got {self.best_of}")
            if self.use_beam_search:
                raise bad("best_of", "does not apply to beam search")
            if self.seed is not None and self.seed > MAX_SEED - (self.best_of - 1):
                raise bad("seed", f"must be at most {MAX_SEED - (self.best_of - 1)} for best_of={self.best_of}")
        if self.prompt_logprobs is not None and not (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", f"must be an integer in 0..20, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs or a dict of its fields")
        if self.use_beam_search:  # beams rank raw logprobs; no processor applies to them
            for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                              ("logit_bias", None), ("bad_words", []), ("structured_outputs", None)):
                if getattr(self, name) not in (off, {}):
                    raise bad(name, "is not supported with beam search")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the model can produce: raises when a stop token id is outside the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequest(f"stop_token_ids: {t} is not a token id (the vocabulary has {vocab_size})",
                                     param="stop_token_ids")


def _token_id_keys(bias: dict) -> dict[int, float]:
    """logit_bias keys arrive as JSON strings ("50256"); they must be token ids."""
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise InvalidRequest(f"logit_bias key {k!r} is not a token id", param="logit_bias") from None
        if tok < 0 or isinstance(k, bool) or (isinstance(k, float) and k != tok):
            raise InvalidRequest(f"logit_bias key {k!r} is not a token id", param="logit_bias")
        out[tok] = v
    return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
