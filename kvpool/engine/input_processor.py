"""The one station where a request is validated and tokenized, before it touches any state.

`kvpool serve` (through `Engine.add_request`, on the engine thread), the conductor's gateway
(with the limits its instances report) and the offline `LLM` all call `InputProcessor.process`,
so the same bad request gets the same error everywhere. What the HTTP front checks itself is
about the HTTP body only (types, strings, fields it does not implement); what a request means
for sampling and whether it can ever run is decided here:

- the parameters' own rules (`SamplingParams.validate`, again: fields may have been assigned
  since construction) and the server's logprob cap;
- everything that needs the vocabulary: prompt ids, stop token ids, logit_bias keys;
- the prompt (text is tokenized here) is not empty, and prompt + max_tokens fits the context;
- a group's samples fit one batch (`max_num_seqs`), and its KV the cache (`capacity`, the
  engine's scheduler; None where no cache is known, as in the gateway);
- its output constraint compiles (`prepare`, the engine's sampling controls).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

# raises InvalidRequest when a group of `prompt_len` tokens and these params can never fit the KV cache
Capacity = Callable[[int, SamplingParams], None]
# the engine's per-request sampling state (bad words as ids, a compiled grammar); raises
# InvalidRequest for a constraint that does not compile
Prepare = Callable[[SamplingParams], Any]


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What a request is checked against; None: not known here (then not checked)."""

    vocab_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_logprobs: int = 20


@dataclass(slots=True)
class EngineRequest:
    """A validated request on token ids, ready for the engine core."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when it came as text
    request_id: str | None = None
    arrival_time: float | None = None
    cache_salt: str | None = None
    controls: Any = None  # what `prepare` made (kvpool.engine.controls.RequestState)


class InputProcessor:
    """Validation and tokenization for one model and its serving limits."""

    def __init__(self, tokenizer: Any, limits: InputLimits, capacity: Capacity | None = None,
                 prepare: Prepare | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.capacity = capacity
        self.prepare = prepare

    def process(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> EngineRequest:
        """The request, checked and on token ids; raises InvalidRequest naming the bad value."""
        params = self.check_params(params)
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest(f"request_id must be a string, got {request_id!r}", param="request_id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequest(f"cache_salt must be a string, got {cache_salt!r}", param="cache_salt")
        if arrival_time is not None and (not isinstance(arrival_time, int | float) or not math.isfinite(arrival_time)):
            raise InvalidRequest(f"arrival_time must be a finite number, got {arrival_time!r}", param="arrival_time")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text, token_ids = None, list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise InvalidRequest("prompt token ids must be integers", param="prompt")
            self._check_ids(token_ids, "prompt")
        self.check_fits(len(token_ids), params)
        controls = self.prepare(params) if self.prepare is not None else None
        return EngineRequest(token_ids, params, text, request_id, arrival_time, cache_salt, controls)

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """The parameters' own rules and everything about them the vocabulary and caps decide."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}", param="params")
        params.validate()
        self._check_ids(params.stop_token_ids, "stop_token_ids")
        self._check_ids(list(params.logit_bias or ()), "logit_bias")
        cap = self.limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > cap:
                raise InvalidRequest(f"{name} must be <= {cap}, got {value}", param=name)
        return params

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """The request can ever run: a prompt, within the context, its samples in one batch, its
        KV in the cache (a request that never fits would wait forever)."""
        if prompt_len == 0:
            raise InvalidRequest("prompt is empty", param="prompt")
        limit = self.limits.max_model_len
        total = prompt_len + params.max_tokens
        if limit is not None and total > limit:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length of {limit} tokens",
                param="max_tokens" if prompt_len < limit else "prompt",
            )
        width, max_seqs = params.num_samples, self.limits.max_num_seqs
        if max_seqs is not None and width > max_seqs:
            name = "best_of" if params.best_of else "n"
            raise InvalidRequest(f"{name}={width} sequences cannot run in one batch of at most "
                                 f"{max_seqs} (max_num_seqs)", param=name)
        if self.capacity is not None:
            self.capacity(prompt_len, params)

    def _check_ids(self, ids: Seq[int], param: str) -> None:
        check_token_ids(ids, self.limits.vocab_size, param)


def check_token_ids(ids: Seq[int], vocab_size: int | None, param: str) -> None:
    """Every id is a token of a vocabulary of `vocab_size` (None: not known, not checked)."""
    if vocab_size is None:
        return
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{param}: token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                                 param=param)
