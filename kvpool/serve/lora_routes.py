"""LoRA adapters over HTTP as vLLM serves them: a request chooses its adapter by `model`, and
with `--allow-runtime-lora-updating` (kvpool/serve/lora_args.py) `POST /v1/load_lora_adapter`
and `/v1/unload_lora_adapter` load and unload them. Loading and unloading change what every client is served, so they
need the `--admin-api-key` where the server has one, else an API key (any route does).
Both run on the engine thread between two steps; an adapter an unfinished request uses is not
unloaded (409): its remaining tokens would be computed without it.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from kvpool.engine.lora.adapters import AdapterInUse, AdapterSet, enable_lora
from kvpool.engine.lora.config import LoraConfig
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.serve import front
from kvpool.serve.auth import KeyRing, bearer_token
from kvpool.serve.errors import ModelNotFound, Unauthenticated, error_body
from kvpool.serve.state import ServerState


def attach_adapters(engine, config: LoraConfig, modules: list[tuple[str, str]], reserved: frozenset[str]) -> AdapterSet:
    """Give the engine its adapter set and load --lora-modules (a bad one stops the start)."""
    lora = enable_lora(engine, config)
    for name, path in modules:
        try:
            lora.load(name, path, reserved)
        except InvalidRequest as e:
            raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
    return lora


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names identify adapters here


def manager_key(keys: KeyRing):
    """The dependency: the admin key where the server has one, else an API key."""

    def check(request: Request) -> None:
        if keys.admin is None:
            keys.api_key(request)
        elif not keys.is_admin(bearer_token(request.headers.get("authorization"))):
            raise Unauthenticated("loading and unloading LoRA adapters needs the --admin-api-key")

    return check


def adapter_card(state: ServerState, name: str) -> dict:
    """vLLM's card of a LoRA adapter: its directory as `root`, the base model as `parent`."""
    adapter = state.lora.adapters[name]
    return {**front.model_card(name, str(adapter.path), state.created, state.max_model_len),
            "parent": state.model_name}


def adapter_cards(state: ServerState) -> list[dict]:
    return [] if state.lora is None else [adapter_card(state, n) for n in list(state.lora.adapters)]


def _unfinished(engine) -> list:
    sched = engine.scheduler
    return [*sched.waiting, *sched.running, *sched.swapped]


async def _between_steps(state: ServerState, fn, success: str) -> Response:
    """Run `fn(engine)` on the engine thread; an adapter still in use is a 409 conflict."""
    try:
        await state.engine.call(fn)
    except AdapterInUse as e:
        return JSONResponse(error_body(str(e), "conflict_error", "lora_name", "adapter_in_use"), status_code=409)
    return PlainTextResponse(success)


def build_lora_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(manager_key(state.keys))])
    reserved = frozenset({state.model_name, *state.served_names, *state.aliases})

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest) -> PlainTextResponse:
        def load(engine) -> None:
            if req.load_inplace and req.lora_name in engine.lora.adapters:
                engine.lora.unload(req.lora_name, _unfinished(engine))
            engine.lora.load(req.lora_name, req.lora_path, reserved)

        return await _between_steps(state, load, f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest) -> PlainTextResponse:
        if req.lora_name not in state.lora.adapters:
            raise ModelNotFound(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")
        return await _between_steps(state, lambda engine: engine.lora.unload(req.lora_name, _unfinished(engine)),
                                    f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
