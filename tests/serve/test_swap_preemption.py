"""#31 item 8: forced swap preemption under concurrent load. A KV pool far smaller than the
requests' decode growth makes the scheduler swap groups out to host memory and back; every
output still equals the request run alone (greedy, in bfloat16 and float32; tokens and logprobs
bitwise in the engine, texts over HTTP) and the pool ends where it began."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import start_server, wait_idle

from kvpool.engine.llm import LLM
from kvpool.sched.sampling_params import SamplingParams

DTYPES = ["bfloat16", "float32"]
PROMPTS = [f"Story {i}: the keeper of the lighthouse on island number {i} wrote in the log" for i in range(4)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_preemption_in_the_engine_keeps_outputs_equal_and_frees_every_block(dtype):
    """The quick one: 4 blocks of 16 slots; two ~18-token prompts growing by 16 need 6 at once."""
    llm = LLM(num_blocks=4, max_model_len=64, preemption_mode="swap", swap_space="16MiB", dtype=dtype)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = PROMPTS[:2]

    def served(outs) -> list[tuple[list[int], list]]:
        return [(o.outputs[0].token_ids, list(o.outputs[0].logprobs or [])) for o in outs]

    solo = [served(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert all(len(lp) == 16 for _, lp in solo)  # logprobs are compared too
    before = llm.engine.scheduler.num_preemptions
    together = served(llm.generate(prompts, params, use_tqdm=False))
    sched = llm.engine.scheduler
    assert sched.num_preemptions > before, "the pool was meant to be too small for all four at once"
    assert together == solo
    usage = sched.kv.usage()
    assert sched.num_swapped_blocks > 0  # swapped back in, not recomputed
    assert usage.free_blocks == usage.total_blocks and sched.kv.host.num_free == sched.kv.host.num_blocks
    assert not sched.swapped and not sched.running and not sched.waiting


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_preemption_under_concurrent_http_load_matches_solo_and_returns_to_baseline(dtype):
    """8 blocks of 16 slots; eight concurrent ~18-token prompts growing by 40 need ~32."""
    flags = ["--num-blocks", "8", "--max-model-len", "128", "--max-num-seqs", "8", "--preemption-mode", "swap",
             "--swap-space", "64MiB", "--dtype", dtype]
    server = start_server(*flags)
    try:
        body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=300) as c:
            solo = [c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                    for p in PROMPTS]
        baseline = wait_idle(server)

        async def load() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                rs = await asyncio.gather(*(c.post("/v1/completions", json={**body, "prompt": p})
                                            for p in PROMPTS * 2))
            return [r.json()["choices"][0]["text"] for r in rs]

        assert asyncio.run(load()) == solo * 2
        after = wait_idle(server)
        assert after["kvpool:num_preemptions_total"] > baseline["kvpool:num_preemptions_total"]
        for gauge in ("kvpool:kv_blocks_free", "kvpool:num_requests_swapped", "kvpool:num_requests_running"):
            assert after[gauge] == baseline[gauge], gauge
    finally:
        assert server.stop() == 0
