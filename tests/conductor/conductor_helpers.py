"""Requests over a fixed block chain and a predictor with round numbers, shared by the
conductor tests."""

from kvpool.conductor import LinearPredictor, RouteRequest, TransferCost

BLOCK = 16
CHAIN = [bytes([i]) * 4 for i in range(64)]


def make_request(rid: str, blocks: int = 20, max_tokens: int = 10, extra: int = 1) -> RouteRequest:
    """A prompt of `blocks` full blocks (the shared chain) plus `extra` tokens."""
    return RouteRequest(rid, blocks * BLOCK + extra, CHAIN[:blocks], max_tokens)


def make_predictor() -> LinearPredictor:
    """1 ms per prefill token; decode step 10 ms + 10 ms per sequence; 1 ms per block pulled
    plus 1 ms latency."""
    return LinearPredictor(
        prefill_s_per_token=1e-3,
        decode_step_s=0.01,
        decode_s_per_seq=0.01,
        transfer=TransferCost(bandwidth_bytes_per_s=1e9, latency_s=1e-3, block_bytes=10**6),
    )
