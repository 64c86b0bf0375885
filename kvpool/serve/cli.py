"""`kvpool serve`: load the engine, start the OpenAI-compatible server, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import time
from pathlib import Path

import uvicorn
from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.errors import ConfigError
from kvpool.serve.auth import ADMIN_KEY_ENV, add_auth_arguments, keyring_from_args
from kvpool.serve.conn_guard import ConnectionLimits, guarded_h11
from kvpool.serve.gate import DEFAULT_MAX_REQUEST_BYTES
from kvpool.serve.lora_args import add_lora_arguments, lora_setup
from kvpool.serve.tools import TOOL_CALL_PARSERS
from kvpool.sizes import parse_bytes

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    group.add_argument("--port", type=int, default=8000)
    add_auth_arguments(group)
    group.add_argument("--admin-api-key", default=os.environ.get(ADMIN_KEY_ENV), metavar="KEY",
                       help=f"the key for whole-server operations (POST /reset_prefix_cache of every "
                            f"tenant's blocks); a tenant's --api-key acts on its own namespace only "
                            f"(default: ${ADMIN_KEY_ENV})")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model ids clients may use; the first is the one /v1/models and responses "
                            "report (default: the model file's or directory's name; the --model path is "
                            "accepted too)")
    group.add_argument("--chat-template", default=None, metavar="PATH",
                       help="a jinja chat template file replacing the model's own")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how the model writes tool calls; enables tool_choice \"auto\" (hermes: "
                            "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's command lines; needs --tool-call-parser, which alone "
                            "enables tool_choice \"auto\"")
    group.add_argument("--max-queue", type=int, default=1024,
                       help="most requests allowed to wait for admission; beyond it new ones get 429")
    group.add_argument("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
                       help="largest request body accepted (e.g. 4MiB); larger ones get 413 (default: 4 MiB)")
    add_connection_arguments(group)
    add_lora_arguments(parser)
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    group.add_argument("--watchdog-timeout", type=float, default=60.0,
                       help="/health turns 503 when the engine completes no step for this many seconds "
                            "while work is pending")
    group.add_argument("--metrics-prefix", default="kvpool",
                       help="prefix of the /metrics names; `vllm` makes vLLM's Grafana dashboards work unchanged")
    group.add_argument("--record-requests", default=None, metavar="FILE",
                       help="write one JSON line per finished request (arrival, the prompt's block hashes, "
                            "lengths, tenant scope, cached tokens, TTFT; no text or token ids) for "
                            "`kvpool sim replay FILE`")
    group.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                       help="serve as a cluster member for `kvpool conductor`: publish KV events and load "
                            "on /internal routes (default: standalone)")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM / SIGINT drains before it stops: the listener stays
    open and answers 503 to new requests, in-flight ones get `drain_s` to finish, the rest end
    with an error (an error event then `data: [DONE]` for a stream); then uvicorn shuts down.
    A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, engine, drain_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s
        self._signalled = False
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._signalled:
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        self._captured_signals.append(sig)

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        logger.info("draining: new requests get 503; %d in flight", self.engine.num_in_flight)
        await self.engine.drain(self.drain_s)
        deadline = time.monotonic() + 5.0  # let the last responses (error events) reach their clients
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def check_port_free(host: str, port: int) -> None:
    """Fail in a second, not after the model has loaded, when the address is taken."""
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def read_chat_template(path: str | None) -> str | None:
    """The --chat-template file's text, read (and its syntax checked) before the model loads."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template {path}: line {e.lineno}: {e.message}") from None
    return text


def served_names(args: argparse.Namespace, loaded) -> tuple[str, ...]:
    """--served-model-name in order, else the model's own name: the GGUF file's stem or the
    directory's name (the engine's id adds a config hash, which clients should not need)."""
    if args.served_model_name:
        return tuple(dict.fromkeys(args.served_model_name))
    path = Path(loaded.path)
    return (path.name if path.is_dir() else path.stem,)


def model_aliases(args: argparse.Namespace, loaded, names: tuple[str, ...]) -> frozenset[str]:
    """Every name a request's `model` may use besides the first: the other served names, the
    path as given on the command line and resolved, and the engine's hashed id."""
    given = [args.model] if args.model else []
    return frozenset({*names[1:], *given, str(loaded.path), str(Path(loaded.path).resolve()), loaded.name})


def add_connection_arguments(group: argparse._ArgumentGroup) -> None:
    """The slow-client limits every kvpool HTTP server takes (`server_config` applies them)."""
    group.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                       help="seconds a request's headers may take to arrive (from the connection, or from the "
                            "request's first byte); a slower client is disconnected (default: 10)")
    group.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                       help="seconds a request's body may take after its headers (default: 60)")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                       help="seconds an idle keep-alive connection stays open between requests (default: 5)")
    group.add_argument("--max-connections-per-client", type=int, default=512, metavar="N",
                       help="concurrent connections one client address may hold; more are closed at once "
                            "(0: no cap; default: 512; a conductor talks to its instances from one address)")


def server_config(app, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's config for `app` with the connection limits of `args` (checked here)."""
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not value > 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if args.max_connections_per_client < 0:
        raise ConfigError(f"--max-connections-per-client must be >= 0, got {args.max_connections_per_client}")
    limits = ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections_per_client)
    return uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                          access_log=False, http=guarded_h11(limits), timeout_keep_alive=args.timeout_keep_alive)


def main(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.watchdog_timeout <= 0:
        raise ConfigError(f"--watchdog-timeout must be > 0, got {args.watchdog_timeout}")
    max_request_bytes = parse_bytes(args.max_request_bytes, "--max-request-bytes")
    if max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes must be at least 1KiB, got {args.max_request_bytes}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    chat_template = read_chat_template(args.chat_template)
    keys = keyring_from_args(args)
    if keys.open and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    if args.role:
        args.publish_kv_events = True  # the conductor drains them through /internal/state
    server_config(None, args)  # the connection limits, checked before the model loads
    config = engine_config_from_args(args)  # every engine flag checked before anything loads
    lora = lora_setup(args)  # --enable-lora and its flags, likewise
    check_port_free(args.host, args.port)
    if args.record_requests and not Path(args.record_requests).parent.is_dir():
        raise ConfigError(f"--record-requests {args.record_requests}: its directory does not exist")

    from kvpool.engine.engine import Engine  # torch: only when actually serving
    from kvpool.serve.app import build_app
    from kvpool.serve.async_engine import AsyncEngine
    from kvpool.serve.metrics import ServerMetrics
    from kvpool.serve.recorder import RequestRecorder
    from kvpool.serve.state import ServerState

    def make_metrics(engine: Engine) -> ServerMetrics:
        metrics = ServerMetrics.for_engine(engine, served_names(args, engine.loaded)[0], args.metrics_prefix)
        if args.record_requests:
            metrics.recorder = RequestRecorder(args.record_requests, engine.block_size)
        return metrics

    async_engine = AsyncEngine.launch(lambda: Engine(config), make_metrics, max_queue=args.max_queue,
                                      watchdog_s=args.watchdog_timeout)
    engine = async_engine.engine
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template  # nothing has rendered with the model's own yet
    names = served_names(args, engine.loaded)
    name = names[0]
    sched_cfg = engine.scheduler.config
    aliases = model_aliases(args, engine.loaded, names)
    adapters = None
    if lora is not None:
        from kvpool.serve.lora_routes import attach_adapters, build_lora_router

        adapters = attach_adapters(engine, *lora, aliases | set(names))
    state = ServerState(
        engine=async_engine,
        tokenizer=engine.tokenizer, model_name=name, aliases=aliases,
        max_model_len=engine.max_model_len, kv_capacity_tokens=sched_cfg.num_blocks * sched_cfg.block_size,
        vocab_size=engine.loaded.config.vocab_size, keys=keys, tool_call_parser=args.tool_call_parser,
        served_names=names, lora=adapters,
    )
    app = build_app(state, args.shutdown_timeout, max_request_bytes)
    if adapters is not None and args.allow_runtime_lora_updating:
        app.include_router(build_lora_router(state))
    if args.role:
        from kvpool.serve.internal import build_internal_router

        app.include_router(build_internal_router(state, args.role, args.kv_remote))
    server = DrainingServer(server_config(app, args), async_engine, args.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has drained; a no-op handler makes that a clean exit
    signal.signal(signal.SIGTERM, lambda *_: None)
    auth = " -H \"Authorization: Bearer $KVPOOL_API_KEY\"" if not keys.open else ""
    url = f"http://{args.host}:{args.port}"
    print(f"kvpool serving {name!r} on {url}\n  curl {url}/v1/completions -H 'Content-Type: application/json'"
          f"{auth} -d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
    # What is alive now (model, tokenizer, app: ~190k objects for the bundled model) lives as long
    # as the process: frozen, a full collection no longer walks it on the engine thread (55 ms).
    gc.collect()
    gc.freeze()
    server.run()
    logger.info("server stopped")
    return 0
