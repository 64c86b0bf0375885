"""`kvpool cluster up|down`: a whole local cluster (pool, instances, conductor) on loopback."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kvpool.errors import ConfigError

DEFAULT_STATE = Path.home() / ".cache" / "kvpool" / "cluster.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start a pool, instances and a conductor on free loopback ports")
    up.add_argument("--prefill", type=int, default=2, help="prefill instances")
    up.add_argument("--decode", type=int, default=2, help="decode instances")
    up.add_argument("--colocated", type=int, default=0, help="colocated (--role both) instances instead")
    up.add_argument("--pool", choices=("redis", "mooncake", "none"), default="redis")
    up.add_argument("--instance-args", default="--kv-cache-memory 256MiB",
                    help="extra `kvpool serve` flags for every instance, one quoted string")
    up.add_argument("--conductor-args", default="",
                    help="extra `kvpool conductor` flags, e.g. '--policy cache-aware --ttft-slo 2'")
    up.add_argument("--state-file", type=Path, default=DEFAULT_STATE)
    down = sub.add_parser("down", help="stop everything `cluster up` started")
    down.add_argument("--state-file", type=Path, default=DEFAULT_STATE)


def main(args: argparse.Namespace) -> int:
    from kvpool.cluster.local import ClusterSpec, LocalCluster, stop_from_state

    if args.action == "down":
        if not args.state_file.exists():
            raise ConfigError(f"no cluster state at {args.state_file} (nothing to stop)")
        print(f"stopped {stop_from_state(args.state_file)} process(es)")
        return 0
    if args.state_file.exists():
        raise ConfigError(f"{args.state_file} exists: run `kvpool cluster down` first")
    spec = ClusterSpec(prefill=args.prefill, decode=args.decode, colocated=args.colocated, pool=args.pool,
                       instance_args=shlex.split(args.instance_args),
                       conductor_args=shlex.split(args.conductor_args))
    cluster = LocalCluster(spec)
    cluster.up()
    args.state_file.parent.mkdir(parents=True, exist_ok=True)
    cluster.write_state(args.state_file)
    url = cluster.conductor_url
    print(f"\ncluster up: {url}  (logs in {cluster.log_dir}, state in {args.state_file})\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'\n  curl {url}/cluster\n"
          f"  kvpool cluster down")
    return 0
