"""Offline API: `LLM().generate(prompts, params)` and `LLM().chat(messages)`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tqdm import tqdm

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.loader import LoadedModel
from kvpool.engine.outputs import FinishedOutputs, RequestOutput
from kvpool.engine.prompts import normalize_prompts
from kvpool.errors import KVPoolError
from kvpool.sched.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | dict  # dicts as vLLM's: {"prompt": ...} or {"prompt_token_ids": [...]}


class LLM:
    """Runs a batch of prompts to completion through the engine's continuous batching."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: LoadedModel | None = None) -> LLM:
        """An LLM on `config` (on `loaded`, a model already in memory, when given)."""
        llm = cls.__new__(cls)
        llm.engine = Engine(config, loaded)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single string, token list or prompt dict is one
        prompt; `sampling_params=` is vLLM's name for `params`."""
        prompts = normalize_prompts(prompts)
        if params is not None and sampling_params is not None:
            raise ValueError("give params or sampling_params, not both")
        params = params or sampling_params or SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"got {len(per)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, per, strict=True):
                ids.append(self.engine.add_request(p.prompt, sp, cache_salt=p.cache_salt))
        except Exception:
            for rid in ids:  # all prompts or none
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, leave=False)
        try:
            done = step_until_done(self.engine, lambda _: bar.update(1))
        finally:
            bar.close()
        failed = [o for o in done.values() if o.error is not None]
        if failed:
            raise KVPoolError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [done[i] for i in ids]


def run_to_completion(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Add `prompts` together and step until every one finishes; final outputs in prompt order
    (a failed request's output carries its error). The offline loop tests and benchmarks share."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = step_until_done(engine)
    return [done[i] for i in ids]


def step_until_done(engine: Engine, on_finish: Callable[[RequestOutput], object] | None = None,
                    ) -> dict[str, RequestOutput]:
    """Step while anything is unfinished; every request's whole output by id (its deltas folded)."""
    finished = FinishedOutputs()
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in finished.add(engine.step()):
            done[out.request_id] = out
            if on_finish is not None:
                on_finish(out)
    return done
