"""Synthetic workloads: length distributions, arrival processes, shared prefixes, multi-turn.

Every generator is a pure function of its spec and seed (numpy PCG64), so the same seed gives
byte-identical workloads. Prompts are described as content-addressed chunks (see tokens.py),
which lets the real KV manager's prefix hashing see shared prefixes as equal tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvpool.core.retention import RetentionRequest, prefix_keys, retain_hashes
from kvpool.errors import ConfigError
from kvpool.sim.tokens import BlockHasher, Chunks

# Chunk-id spaces, so trace hash ids, synthetic pieces and generated outputs never collide.
SYNTHETIC_CHUNK_BASE = 1 << 40
OUTPUT_CHUNK_BASE = 1 << 41

FEW_SHOT_PREFIX = {1: 80, 5: 341}  # tokens of the shared 1-shot / 5-shot prefix (vLLM paper)


@dataclass(slots=True, frozen=True)
class SimRequest:
    """A request as the simulator sees it: lengths, arrival and its prompt as chunks.

    `chunks` tile the prompt ((chunk_id, tokens) summing to prompt_len); `output_chunk` names
    the generated tokens, so a multi-turn follow-up can reuse them as prompt.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    chunks: Chunks
    output_chunk: int
    n: int = 1
    beam_width: int = 1
    session_id: str | None = None
    turn: int = 0
    retention: tuple[RetentionRequest, ...] = ()  # as SamplingParams.retention (core/retention.py)


@dataclass(slots=True, frozen=True)
class SimPin:
    """An operator's pin (`POST /v1/kv/pin`) at `at_s` of the prompt blocks `chunks` name, with
    `retention` over all of them; without (None), an unpin of them."""

    at_s: float
    chunks: Chunks
    retention: RetentionRequest | None = None

    def apply(self, kv, hasher: BlockHasher) -> int:
        """Pin or unpin the blocks in `kv` (a KVCacheManager), hashed as its instance hashes
        prompts (`hasher`), as the routes do (core/retention.py); returns the keys affected."""
        hashes = hasher.hashes(self.chunks)
        if self.retention is not None:
            return retain_hashes(kv, hashes, self.retention, self.at_s)
        table = kv.pool.retention
        return 0 if table is None else table.release(prefix_keys(kv.group_keys, hashes, kv.num_groups))


@dataclass(slots=True, frozen=True)
class LengthDist:
    """Log-normal prompt and output lengths with the given means (sigma in log space)."""

    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float

    def sample(self, rng: np.random.Generator, count: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_lens, output_lens), each >= 1 and prompt + output <= max_len."""
        if max_len < 2:
            raise ConfigError(f"max_len={max_len} must be >= 2")
        inp = _lognormal(rng, self.input_mean, self.input_sigma, count)
        out = _lognormal(rng, self.output_mean, self.output_sigma, count)
        inp = np.clip(inp, 1, max_len - 1)
        out = np.clip(out, 1, max_len - inp)
        return inp, out


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, count: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return np.maximum(np.rint(rng.lognormal(mu, sigma, count)), 1).astype(np.int64)


# Means from the vLLM paper's dataset statistics; spreads chosen to match their histograms' shape.
SHAREGPT = LengthDist("sharegpt", 161.0, 1.0, 338.0, 0.9)
ALPACA = LengthDist("alpaca", 19.0, 0.6, 58.0, 0.8)
LENGTHS = {d.name: d for d in (SHAREGPT, ALPACA)}


def get_lengths(name: str) -> LengthDist:
    try:
        return LENGTHS[name]
    except KeyError:
        raise ConfigError(f"unknown length distribution {name!r}; choose one of {sorted(LENGTHS)}") from None


def arrival_times(rng: np.random.Generator, count: int, rate: float, cv: float = 1.0) -> np.ndarray:
    """Arrival instants (s) at `rate` req/s: Poisson for cv=1, Gamma gaps (bursty) for cv>1.

    rate=inf puts every request at t=0 (offline batch).
    """
    if rate <= 0 or cv <= 0:
        raise ConfigError(f"rate={rate} and cv={cv} must be > 0")
    if math.isinf(rate):
        return np.zeros(count)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """An open-loop single-turn workload."""

    num_requests: int = 1000
    rate: float = 1.0
    lengths: str = "sharegpt"
    arrival_cv: float = 1.0
    shared_prefix_len: int = 0  # tokens of a prefix every prompt starts with (few-shot)
    n: int = 1
    beam_width: int = 1
    max_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.n < 1 or self.beam_width < 1:
            raise ConfigError(f"bad workload spec {self}")
        if self.shared_prefix_len >= self.max_len - 1:
            raise ConfigError(
                f"shared_prefix_len={self.shared_prefix_len} leaves no room under max_len={self.max_len}"
            )


def synthetic_workload(spec: WorkloadSpec) -> list[SimRequest]:
    """Requests with sampled lengths and arrivals; the shared prefix (if any) is one chunk
    every prompt starts with, followed by the request's own chunk."""
    rng = np.random.default_rng(spec.seed)
    budget = spec.max_len - spec.shared_prefix_len
    inp, out = get_lengths(spec.lengths).sample(rng, spec.num_requests, budget)
    arrivals = arrival_times(rng, spec.num_requests, spec.rate, spec.arrival_cv)
    prefix: Chunks = ((SYNTHETIC_CHUNK_BASE, spec.shared_prefix_len),) if spec.shared_prefix_len else ()
    reqs = []
    for i in range(spec.num_requests):
        own = (SYNTHETIC_CHUNK_BASE + 1 + i, int(inp[i]))
        reqs.append(
            SimRequest(
                request_id=f"req-{i}",
                arrival_s=float(arrivals[i]),
                prompt_len=spec.shared_prefix_len + int(inp[i]),
                output_len=int(out[i]),
                chunks=(*prefix, own),
                output_chunk=OUTPUT_CHUNK_BASE + i,
                n=spec.n,
                beam_width=spec.beam_width,
            )
        )
    return reqs


@dataclass(slots=True, frozen=True)
class ChatSpec:
    """Multi-turn chat sessions: each turn's prompt = previous prompt + previous answer + new
    question. Open loop: turn t+1 arrives an exponential think time after turn t's arrival, so
    a driver that wants causality should also hold a turn until its predecessor finishes."""

    num_sessions: int = 100
    session_rate: float = 0.5
    turns: int = 4
    think_time_s: float = 10.0
    lengths: str = "sharegpt"
    max_len: int = 4096
    seed: int = 0
    system_prompt_len: int = 0  # shared by every session


def multi_turn_workload(spec: ChatSpec) -> list[SimRequest]:
    """Sessions of up to `turns` turns, stopped early when the conversation outgrows max_len;
    returned sorted by arrival (ties by session, turn)."""
    rng = np.random.default_rng(spec.seed)
    dist = get_lengths(spec.lengths)
    starts = arrival_times(rng, spec.num_sessions, spec.session_rate)
    system: Chunks = ((SYNTHETIC_CHUNK_BASE, spec.system_prompt_len),) if spec.system_prompt_len else ()
    reqs: list[SimRequest] = []
    next_id = SYNTHETIC_CHUNK_BASE + 1
    for s in range(spec.num_sessions):
        q_lens, a_lens = dist.sample(rng, spec.turns, spec.max_len)
        gaps = rng.exponential(spec.think_time_s, spec.turns)
        chunks, t = system, float(starts[s])
        for turn in range(spec.turns):
            chunks = (*chunks, (next_id, int(q_lens[turn])))
            next_id += 1
            prompt_len = sum(n for _, n in chunks)
            if prompt_len + int(a_lens[turn]) > spec.max_len:
                break
            out_chunk = OUTPUT_CHUNK_BASE + len(reqs)
            reqs.append(
                SimRequest(f"s{s}-t{turn}", t, prompt_len, int(a_lens[turn]), chunks, out_chunk,
                           session_id=f"s{s}", turn=turn)
            )
            chunks = (*chunks, (out_chunk, int(a_lens[turn])))
            t += float(gaps[turn])
    reqs.sort(key=lambda r: (r.arrival_s, r.session_id or "", r.turn))
    return reqs
