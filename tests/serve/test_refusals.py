"""#31 item 3: every refusal is classified once. A request no retry can ever serve (more prompts
than the queue holds, a prompt beyond the context, more KV than the whole cache) is a 400 naming
the field and the limit; only a full queue, which drains, is a 429 with Retry-After and a true count."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import AUTH

from kvpool.engine.input_processor import InputLimits, InputProcessor
from kvpool.errors import InvalidRequest, Overloaded
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig
from kvpool.serve.async_engine import AsyncEngine, _Add
from kvpool.serve.metrics import ServerMetrics


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=120)


def _assert_400(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_more_prompts_than_the_queue_holds_is_a_400_naming_prompt_and_the_limit(server):
    _assert_400(_post(server, {"prompt": ["hi"] * 2000, "max_tokens": 1}), "prompt", "2000", "1024", "--max-queue")


def test_a_prompt_longer_than_the_context_is_a_400_naming_prompt(server):
    _assert_400(_post(server, {"prompt": [11] * 1100, "max_tokens": 1}), "prompt", "1024")


def test_max_tokens_beyond_the_context_is_a_400_naming_max_tokens(server):
    _assert_400(_post(server, {"prompt": "hi", "max_tokens": 5000}), "max_tokens", "1024")


def test_more_kv_than_the_whole_cache_is_a_400(server):
    # n=8 samples of 600 tokens each need more than the 256 blocks of 16 the server has
    _assert_400(_post(server, {"prompt": [11] * 400, "max_tokens": 600, "n": 8}), "max_tokens", "256")


class _Waiting:
    def __init__(self, n: int) -> None:
        config = type("C", (), {"max_num_seqs": 8})()
        self.scheduler = type("S", (), {"waiting": [object()] * n, "config": config})()


def test_a_full_queue_is_a_429_that_counts_what_waits_and_what_the_request_adds():
    engine = AsyncEngine(_Waiting(3), ServerMetrics("m"), max_queue=4)

    async def refused() -> Exception:
        engine._loop = asyncio.get_running_loop()
        accepted = engine._loop.create_future()
        engine._apply(_Add(["a", "b"], [[1], [2]], SamplingParams(max_tokens=1), 0.0, None, asyncio.Queue(), accepted))
        with pytest.raises(Overloaded) as e:
            await accepted
        return e.value

    e = asyncio.run(refused())
    assert "3 of at most 4 requests are waiting" in str(e) and "adds 2" in str(e) and e.retry_after_s >= 1


def test_a_request_the_queue_could_never_hold_is_refused_before_it_is_queued():
    engine = AsyncEngine(_Waiting(0), ServerMetrics("m"), max_queue=4)
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(engine.submit("r", [[1]] * 5, SamplingParams(max_tokens=1), 0.0))
    assert e.value.param == "prompt" and engine._commands.empty()


@pytest.mark.parametrize(("fields", "param"), [({"n": 9}, "n"), ({"n": 2, "best_of": 9}, "best_of")])
def test_more_samples_than_one_batch_holds_is_refused_by_name(fields, param):
    # a group's samples run in one batch: 9 of them under max_num_seqs 8 would wait forever, in the
    # server and in the offline LLM alike (both go through the one input processor)
    sched = Scheduler(SchedulerConfig(num_blocks=64, max_num_seqs=8))
    inputs = InputProcessor(None, InputLimits(max_num_seqs=8), capacity=sched.check_capacity)
    params = SamplingParams(max_tokens=1, temperature=1.0, **fields)
    with pytest.raises(InvalidRequest, match="max_num_seqs") as e:
        inputs.check_fits(2, params)
    assert e.value.param == param and not sched.waiting and not sched.groups


@pytest.mark.parametrize("continuous", [True, False])
def test_continuous_usage_stats_is_refused_by_name_not_ignored(continuous):
    from kvpool.errors import InvalidRequest
    from kvpool.serve.protocol import CompletionRequest

    body = CompletionRequest.model_validate({"prompt": "hi", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": continuous}})
    if not continuous:
        body.check()
        return
    with pytest.raises(InvalidRequest) as e:
        body.check()
    assert e.value.param == "stream_options.continuous_usage_stats"
