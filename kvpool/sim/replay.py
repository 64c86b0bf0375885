"""`kvpool sim replay FILE`: a real server's request log (`kvpool serve --record-requests`,
kvpool/serve/recorder.py) through the simulator, at the recorded configuration or any other.

A log line names each full prompt block by its salted chained hash, as a Mooncake trace names
its blocks by hash id (kvpool/sim/traces.py), and is read the same way: each distinct hash
becomes a chunk of `block_size` synthetic tokens, the tokens past the last full block a chunk of
the request's own. Equal hashes name equal prefixes (the chain covers every block before), so
the simulator's prefix cache sees exactly the sharing the server saw, tenants apart (their salts
are in the hashes), at any simulated block size. The replay runs the engine's own scheduler
(`run_instance`) with step times from a cost model, and reports its hit rate and mean TTFT
beside the recorded ones. A request's recorded retention (version 2) is its simulated request's,
covering the same blocks from the first; an operator's pin or unpin line is applied at its time
to the blocks it names (`SimPin`), as the route applies it to the server's cache.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from kvpool.core.retention import RetentionRequest
from kvpool.costs.cost_model import CostModel, MeasuredCostModel
from kvpool.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from kvpool.errors import ConfigError, InvalidRequest
from kvpool.sched.scheduler import SchedulerConfig
from kvpool.sim.experiments.base import roofline
from kvpool.sim.instance import InstanceRun, run_instance
from kvpool.sim.metrics import format_table, summarize, write_json
from kvpool.sim.workloads import OUTPUT_CHUNK_BASE, SimPin, SimRequest
from kvpool.sizes import parse_bytes

RECORD_VERSIONS = (1, 2)  # kvpool/serve/recorder.py's, old and new (2 adds retention and pins)
BLOCK_CHUNK_BASE = 1 << 42  # chunk ids of recorded blocks (above trace, synthetic and output ids)
TAIL_CHUNK_BASE = 1 << 43  # each request's tokens past its last full block
_FIELDS = ("arrival_s", "block_size", "block_hashes", "prompt_len", "output_len", "cached_tokens")
_PIN_FIELDS = {"pin": ("at_s", "block_size", "block_hashes", "ttl_s", "priority"),
               "unpin": ("at_s", "block_size", "block_hashes")}


@dataclass(slots=True, frozen=True)
class Recorded:
    """One finished request of the log (what `kvpool serve --record-requests` wrote)."""

    arrival_s: float
    block_size: int
    block_hashes: tuple[str, ...]
    prompt_len: int
    output_len: int
    cached_tokens: int
    ttft_s: float | None = None
    scope: str | None = None
    retention: tuple[RetentionRequest, ...] = ()  # over its first blocks (prefix_tokens: whole blocks)


@dataclass(slots=True, frozen=True)
class RecordedPin:
    """An operator's pin (`retention`: over all of `block_hashes`) or unpin (None) at `at_s`."""

    at_s: float
    block_size: int
    block_hashes: tuple[str, ...]
    retention: RetentionRequest | None = None


@dataclass(slots=True, frozen=True)
class RequestLog:
    """A whole log: its requests in arrival order and its pins and unpins in time order."""

    requests: list[Recorded]
    pins: list[RecordedPin]


def load_log(path: str | Path) -> RequestLog:
    """The log's requests, pins and unpins; a line that is not a record of a known version and
    kind is refused with its line number."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"request log {path} is not a file")
    requests, pins = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or rec.get("v") not in RECORD_VERSIONS:
            raise ConfigError(f"{path}:{n}: not a version-{'/'.join(map(str, RECORD_VERSIONS))} request record")
        try:
            if rec.get("kind", "request") == "request":
                requests.append(_request(rec, f"{path}:{n}"))
            else:
                pins.append(_pin(rec, f"{path}:{n}"))
        except (InvalidRequest, KeyError, TypeError, ValueError) as e:  # a field of the wrong type or range
            raise ConfigError(f"{path}:{n}: bad record ({type(e).__name__}: {e})") from None
    if not requests:
        raise ConfigError(f"request log {path} holds no request")
    sizes = {r.block_size for r in [*requests, *pins]}
    if len(sizes) > 1:
        raise ConfigError(f"request log {path} mixes block sizes {sorted(sizes)}")
    return RequestLog(sorted(requests, key=lambda r: r.arrival_s), sorted(pins, key=lambda p: p.at_s))


def load_record(path: str | Path) -> list[Recorded]:
    """The log's requests in arrival order (`load_log` for its pins too)."""
    return load_log(path).requests


def _request(rec: dict, where: str) -> Recorded:
    missing = [f for f in _FIELDS if f not in rec]
    if missing:
        raise ConfigError(f"{where}: record lacks {missing}")
    size = int(rec["block_size"])
    retention = tuple(RetentionRequest(int(k["blocks"]) * size, k["ttl_s"], k["priority"])
                      for k in rec.get("retention", ()))
    r = Recorded(float(rec["arrival_s"]), size, tuple(rec["block_hashes"]), int(rec["prompt_len"]),
                 int(rec["output_len"]), int(rec["cached_tokens"]), rec.get("ttft_s"), rec.get("scope"), retention)
    if r.prompt_len < 1 or r.block_size < 1 or len(r.block_hashes) > r.prompt_len // r.block_size:
        raise ConfigError(f"{where}: {len(r.block_hashes)} block hashes of {r.block_size} tokens "
                          f"for a prompt of {r.prompt_len}")
    return r


def _pin(rec: dict, where: str) -> RecordedPin:
    kind = rec["kind"]
    if kind not in _PIN_FIELDS:
        raise ConfigError(f"{where}: unknown record kind {kind!r} (request, pin or unpin)")
    missing = [f for f in _PIN_FIELDS[kind] if f not in rec]
    if missing:
        raise ConfigError(f"{where}: {kind} record lacks {missing}")
    retention = RetentionRequest(None, rec["ttl_s"], rec["priority"]) if kind == "pin" else None
    return RecordedPin(float(rec["at_s"]), int(rec["block_size"]), tuple(rec["block_hashes"]), retention)


def replay_requests(records: list[Recorded]) -> list[SimRequest]:
    """Simulator requests of the log: arrivals from the first one's, prompts as chunks."""
    return replay_workload(records)[0]


def replay_workload(records: list[Recorded], pins: Sequence[RecordedPin] = ()) -> tuple[list[SimRequest],
                                                                                         list[SimPin]]:
    """Simulator requests and pins of the log: times from the first request's or pin's, prompts
    and pinned prefixes as chunks (one per distinct block hash)."""
    ids: dict[str, int] = {}
    t0 = min([records[0].arrival_s, *(p.at_s for p in pins)])

    def chunks_of(hashes: tuple[str, ...], size: int) -> list[tuple[int, int]]:
        return [(ids.setdefault(h, BLOCK_CHUNK_BASE + len(ids)), size) for h in hashes]

    reqs = []
    for i, r in enumerate(records):
        chunks = chunks_of(r.block_hashes, r.block_size)
        tail = r.prompt_len - len(r.block_hashes) * r.block_size
        if tail:
            chunks.append((TAIL_CHUNK_BASE + i, tail))
        reqs.append(SimRequest(f"replay-{i}", r.arrival_s - t0, r.prompt_len, max(1, r.output_len), tuple(chunks),
                               OUTPUT_CHUNK_BASE + i, retention=r.retention))
    sim_pins = [SimPin(p.at_s - t0, tuple(chunks_of(p.block_hashes, p.block_size)), p.retention) for p in pins]
    return reqs, sim_pins


def recorded_summary(records: list[Recorded]) -> dict:
    """The server's own figures: prefix hit rate (cached over prompt tokens) and mean TTFT."""
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return {"requests": len(records),
            "prefix_hit_rate": sum(r.cached_tokens for r in records) / sum(r.prompt_len for r in records),
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan}


def replay(records: list[Recorded], config: SchedulerConfig, cost: CostModel,
           pins: Sequence[RecordedPin] = ()) -> tuple[dict, InstanceRun]:
    """The log (and its pins) through one simulated instance; its summary in the recorded
    summary's terms."""
    reqs, sim_pins = replay_workload(records, pins)
    run = run_instance(reqs, config, cost, pins=sim_pins)
    s = summarize(run.metrics)
    return {"requests": s["completed"], "prefix_hit_rate": s["prefix_hit_rate"],
            "ttft_mean_s": s["ttft_s"]["mean"]}, run


def comparison_rows(recorded: dict, replayed: dict) -> list[dict]:
    """Replayed beside recorded, with the relative difference."""
    rows = []
    for key in ("prefix_hit_rate", "ttft_mean_s"):
        a, b = recorded[key], replayed[key]
        rows.append({"metric": key, "recorded": a, "replayed": b,
                     "difference": (b - a) / a if a else (0.0 if b == a else math.inf)})
    return rows


def scheduler_config(config: EngineConfig, records: list[Recorded]) -> SchedulerConfig:
    """The scheduler a server with `config` runs (every field the two share), sized for the log.
    The replay models the device prefix cache; store tiers are refused by name."""
    for flag, value in (("--kv-host-memory", parse_bytes(config.kv_host_memory, "--kv-host-memory")),
                        ("--kv-disk-path", config.kv_disk_path), ("--kv-remote", config.kv_remote)):
        if value:
            raise ConfigError(f"sim replay models the device prefix cache only; {flag} is not simulated")
    if config.num_blocks is None:
        raise ConfigError("sim replay needs --num-blocks (the recorded server logs its KV blocks at start)")
    shared = {f.name for f in fields(SchedulerConfig)} & {f.name for f in fields(EngineConfig)}
    longest = max(r.prompt_len + r.output_len for r in records)
    kwargs = {name: getattr(config, name) for name in shared}
    kwargs["max_model_len"] = max(config.max_model_len or 0, longest)
    kwargs["eviction_policy"] = config.eviction_policy.lower()
    return SchedulerConfig(**kwargs)


def cost_model(args: argparse.Namespace) -> CostModel:
    """Step times from `--profile` (fitted to the recorded machine) or a roofline of presets."""
    if args.profile is not None:
        return MeasuredCostModel.from_profile(args.profile)
    model, sep, hardware = args.roofline.partition(":")
    if not sep:
        raise ConfigError(f"--roofline {args.roofline!r}: expected MODEL:HARDWARE (e.g. smollm2-135m:cpu)")
    return roofline(model, hardware, block_size=args.block_size)[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="a request log of `kvpool serve --record-requests FILE`")
    p.add_argument("--profile", type=Path, default=None,
                   help="step times fitted to a `kvpool bench profile` of the recorded machine")
    p.add_argument("--roofline", default="smollm2-135m:cpu", metavar="MODEL:HARDWARE",
                   help="without --profile: a roofline of these presets (default: smollm2-135m:cpu)")
    p.add_argument("--out", type=Path, default=None, help="also write the comparison here (JSON)")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    log = load_log(args.file)
    records = log.requests
    config = scheduler_config(engine_config_from_args(args), records)
    recorded = recorded_summary(records)
    replayed, _ = replay(records, config, cost_model(args), log.pins)
    rows = comparison_rows(recorded, replayed)
    pinned = f", {len(log.pins)} pins and unpins" if log.pins else ""
    print(f"{len(records)} requests of {args.file}{pinned} replayed ({replayed['requests']} completed)")
    print(format_table(rows, digits=4))
    if args.out is not None:
        write_json(args.out, {"recorded": recorded, "replayed": replayed, "rows": rows})
    return 0
