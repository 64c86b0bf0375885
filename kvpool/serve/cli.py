"""`kvpool serve`: load the engine, start the OpenAI-compatible server, drain on SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import socket

import uvicorn

from kvpool.engine.config import add_engine_args, engine_config_from_args
from kvpool.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` on /v1 routes")
    group.add_argument("--served-model-name", default=None, help="the model id clients use (default: the engine's)")
    group.add_argument("--max-queue", type=int, default=1024,
                       help="most requests allowed to wait for admission; beyond it new ones get 429")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    group.add_argument("--metrics-prefix", default="kvpool",
                       help="prefix of the /metrics names; `vllm` makes vLLM's Grafana dashboards work unchanged")
    group.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                       help="serve as a cluster member for `kvpool conductor`: publish KV events and load "
                            "on /internal routes (default: standalone)")


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


def main(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.role:
        args.publish_kv_events = True  # the conductor drains them through /internal/state
    config = engine_config_from_args(args)  # every engine flag checked before anything loads
    check_port_free(args.host, args.port)

    from kvpool.engine.engine import Engine  # torch: only when actually serving
    from kvpool.serve.app import build_app
    from kvpool.serve.async_engine import AsyncEngine
    from kvpool.serve.metrics import ServerMetrics
    from kvpool.serve.state import ServerState

    def make_metrics(engine: Engine) -> ServerMetrics:
        return ServerMetrics.for_engine(engine, args.served_model_name or engine.loaded.name, args.metrics_prefix)

    async_engine = AsyncEngine.launch(lambda: Engine(config), make_metrics, max_queue=args.max_queue)
    engine = async_engine.engine
    name = args.served_model_name or engine.loaded.name
    sched_cfg = engine.scheduler.config
    state = ServerState(
        engine=async_engine,
        tokenizer=engine.tokenizer, model_name=name, aliases=frozenset({engine.loaded.name}),
        max_model_len=engine.max_model_len, kv_capacity_tokens=sched_cfg.num_blocks * sched_cfg.block_size,
        api_key=args.api_key,
    )
    app = build_app(state, args.shutdown_timeout)
    if args.role:
        from kvpool.serve.internal import build_internal_router

        app.include_router(build_internal_router(state, args.role, args.kv_remote))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has drained; a no-op handler makes that a clean exit
    signal.signal(signal.SIGTERM, lambda *_: None)
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    url = f"http://{args.host}:{args.port}"
    print(f"kvpool serving {name!r} on {url}\n  curl {url}/v1/completions -H 'Content-Type: application/json'"
          f"{auth} -d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
    server.run()
    logger.info("server stopped")
    return 0
