"""`kvpool conductor`: the gateway process (flags -> GatewayConfig + predictor, then uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os

from kvpool.conductor.predictor import CPU_PREDICTOR, StepTimePredictor
from kvpool.conductor.records import POLICIES, REJECTIONS, ConductorConfig
from kvpool.serve.auth import ADMIN_KEY_ENV, add_auth_arguments, api_keys_from_args
from kvpool.serve.cli import add_connection_arguments, server_config
from kvpool.serve.gate import DEFAULT_MAX_REQUEST_BYTES
from kvpool.sizes import parse_bytes

logger = logging.getLogger(__name__)

def _urls(value: str) -> list[str]:
    return [u.strip() for u in value.split(",") if u.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("instances")
    g.add_argument("--prefill", type=_urls, default=[], help="prefill instance URLs, comma-separated")
    g.add_argument("--decode", type=_urls, default=[], help="decode instance URLs, comma-separated")
    g.add_argument("--instances", type=_urls, default=[], help="colocated (--role both) instance URLs")
    g.add_argument("--model", default=None, help="the instances' model (for the tokenizer; default: bundled)")
    g.add_argument("--block-size", type=int, default=16, help="the instances' KV block size")
    g.add_argument("--poll-interval", type=float, default=0.1, help="seconds between /internal/state polls")
    c = parser.add_argument_group("conductor")
    c.add_argument("--policy", choices=POLICIES, default="kv-centric")
    c.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds (reject beyond it)")
    c.add_argument("--tbt-slo", type=float, default=None, help="time-between-tokens SLO in seconds")
    c.add_argument("--rejection", choices=REJECTIONS, default="none")
    c.add_argument("--replication-threshold", type=float, default=2.0)
    c.add_argument("--profile", default=None, help="profile JSON from `kvpool bench profile` (fitted costs)")
    c.add_argument("--seed", type=int, default=0)
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8080)
    add_auth_arguments(s)
    s.add_argument("--admin-api-key", default=os.environ.get(ADMIN_KEY_ENV), metavar="KEY",
                   help=f"the key for cluster pins in any namespace (POST /v1/kv/pin, /v1/kv/unpin through "
                        f"cache_salt); a tenant's --api-key pins in its own only (default: ${ADMIN_KEY_ENV})")
    s.add_argument("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
                   help="largest request body accepted; larger ones get 413 (default: 4 MiB)")
    s.add_argument("--served-model-name", default=None)
    add_connection_arguments(s)


def predictor_from(profile: str | None) -> StepTimePredictor:
    if profile is None:
        return CPU_PREDICTOR
    from kvpool.conductor.predictor import CostModelPredictor
    from kvpool.costs.cost_model import MeasuredCostModel

    return CostModelPredictor(MeasuredCostModel.from_profile(profile))


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpool.cluster.gateway import GatewayConfig, build_gateway
    from kvpool.engine.loader import load_tokenizer

    config = GatewayConfig(
        prefill=args.prefill, decode=args.decode, instances=args.instances,
        conductor=ConductorConfig(policy=args.policy, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                                  rejection=args.rejection, replication_threshold=args.replication_threshold,
                                  block_size=args.block_size, seed=args.seed),
        served_model_name=args.served_model_name, poll_interval_s=args.poll_interval,
        api_keys=api_keys_from_args(args), cluster_key=args.cluster_key, metrics_open=args.metrics_open,
        admin_api_key=args.admin_api_key,
        max_request_bytes=parse_bytes(args.max_request_bytes, "--max-request-bytes"),
    )
    app = build_gateway(config, predictor_from(args.profile), load_tokenizer(args.model))
    url = f"http://{args.host}:{args.port}"
    print(f"kvpool conductor on {url} ({args.policy}, rejection {args.rejection}); cluster state: {url}/cluster",
          flush=True)
    uvicorn.Server(server_config(app, args)).run()
    return 0
