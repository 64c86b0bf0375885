"""No request can break the engine or the requests beside it: bad requests are refused before
they touch any state, a failure while stepping fails only the requests it belongs to, and the
engine keeps serving. Also: a stop string that ends on the last allowed token stops the text."""

from __future__ import annotations

import math

import pytest
from engine_helpers import make_engine

import kvpool.engine.sample_rows as sample_rows
from kvpool.engine.engine import Engine
from kvpool.engine.outputs import FinishedOutputs
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

OTHER = "The capital of France is"
OTHER_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


SMALL = {"num_blocks": 128, "block_size": 16}


def drain(engine: Engine, earlier: list | None = None) -> dict[str, object]:
    """Step until done; each request's whole output (`earlier`: records of steps taken before)."""
    done, finished = {}, FinishedOutputs()
    finished.add(earlier or [])
    for _ in range(500):
        if not engine.has_unfinished():
            break
        done.update({o.request_id: o for o in finished.add(engine.step())})
    assert not engine.has_unfinished()
    return done


def snapshot(engine: Engine) -> tuple:
    s = engine.scheduler
    usage = s.kv.usage()
    return (len(s.waiting), len(s.running), sorted(s.groups), usage.used_blocks, usage.free_blocks,
            sorted(engine.outputs._requests))


def at_baseline(engine: Engine) -> bool:
    kv = engine.scheduler.kv
    return not kv.seqs and kv.num_free_blocks == kv.pool.num_blocks and not engine.outputs._requests and not engine.controls._requests


@pytest.fixture(scope="module")
def solo(loaded):
    engine = make_engine(loaded, **SMALL)
    rid = engine.add_request(OTHER, OTHER_PARAMS)
    return drain(engine)[rid].outputs[0].token_ids


@pytest.mark.parametrize(("params", "field"), [
    (dict(seed=2**70), "seed"),
    (dict(seed=2**64 - 1, n=2, temperature=0.8), "seed"),
    (dict(seed=-1), "seed"),
    (dict(stop_token_ids=[10**12], min_tokens=2), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(temperature=math.nan), "temperature"),
    (dict(length_penalty=math.inf), "length_penalty"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_parameters_are_refused_and_change_nothing(loaded, solo, params, field):
    engine = make_engine(loaded, **SMALL)
    other = engine.add_request(OTHER, OTHER_PARAMS)
    first = engine.step()  # the other request is running
    before = snapshot(engine)
    with pytest.raises(InvalidRequest) as err:
        p = SamplingParams(max_tokens=4)
        for k, v in params.items():  # assigned after construction: add_request checks again
            setattr(p, k, v)
        engine.add_request("hi", p)
    assert err.value.param == field and field in str(err.value)
    assert snapshot(engine) == before
    done = drain(engine, first)
    assert list(done) == [other] and done[other].outputs[0].token_ids == solo
    assert at_baseline(engine)


def test_the_largest_seeds_that_fit_are_accepted(loaded):
    engine = make_engine(loaded, **SMALL)
    a = engine.add_request("hi", SamplingParams(max_tokens=3, seed=2**64 - 1, temperature=0.8))
    b = engine.add_request("hi", SamplingParams(max_tokens=3, seed=2**64 - 2, n=2, temperature=0.8))
    done = drain(engine)
    assert len(done[a].outputs) == 1 and len(done[b].outputs) == 2
    assert all(o.error is None for o in done.values()) and at_baseline(engine)


def test_a_failing_forward_fails_the_step_and_the_engine_keeps_serving(loaded, solo, monkeypatch):
    engine = make_engine(loaded, **SMALL)
    victims = [engine.add_request("hello there", SamplingParams(max_tokens=4, n=2, temperature=0.5)),
               engine.add_request("general kenobi", SamplingParams(max_tokens=4))]
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == sorted(victims)
    assert all(o.finished and "boom" in o.error for o in failed)
    assert at_baseline(engine)
    monkeypatch.setattr(engine.runner, "execute", real)
    other = engine.add_request(OTHER, OTHER_PARAMS)
    done = drain(engine)
    assert done[other].outputs[0].token_ids == solo and done[other].error is None
    assert at_baseline(engine)


def test_a_failing_sampler_row_fails_only_its_request(loaded, solo, monkeypatch):
    engine = make_engine(loaded, **SMALL)
    real = sample_rows.sample

    def picky(logits, params):
        if any(p.temperature == 0.123 for p in params):
            raise ValueError("cannot sample this row")
        return real(logits, params)

    monkeypatch.setattr(sample_rows, "sample", picky)
    bad = engine.add_request("hello", SamplingParams(max_tokens=4, temperature=0.123))
    other = engine.add_request(OTHER, OTHER_PARAMS)
    done = drain(engine)
    assert "cannot sample this row" in done[bad].error
    assert done[other].error is None and done[other].outputs[0].token_ids == solo
    assert at_baseline(engine)


def test_a_failing_detokenizer_fails_only_its_request(loaded, solo, monkeypatch):
    engine = make_engine(loaded, **SMALL)
    bad = engine.add_request("hello", SamplingParams(max_tokens=4, temperature=0.0))
    other = engine.add_request(OTHER, OTHER_PARAMS)
    (text,) = engine.outputs._requests[bad].texts.values()
    monkeypatch.setattr(text.detok, "step", lambda ids: (_ for _ in ()).throw(UnicodeError("bad bytes")))
    done = drain(engine)
    assert "bad bytes" in done[bad].error and done[bad].finished
    assert done[other].error is None and done[other].outputs[0].token_ids == solo
    assert at_baseline(engine)


def test_a_stop_string_ending_on_the_last_allowed_token_stops_and_is_trimmed(loaded):
    engine = make_engine(loaded, **SMALL)
    prompt, stop = "1, 2, 3, 4, 5, 6,", " 9"
    free = drain_one(engine, prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
    assert free.finish_reason == "stop"
    last = len(free.token_ids)  # the token that completes the stop string
    streamed = []
    rid = engine.add_request(prompt, SamplingParams(max_tokens=last, temperature=0.0, stop=[stop]))
    while engine.has_unfinished():
        streamed += [o for o in engine.step() if o.request_id == rid]
    out = streamed[-1].outputs[0]
    assert streamed[-1].finished and out.finish_reason == "stop" and out.stop_reason == stop
    text = "".join(c.text for o in streamed for c in o.outputs)
    assert text == free.text and stop not in text  # no stream chunk shows it, nor two together
    assert at_baseline(engine)


def drain_one(engine: Engine, prompt: str, params: SamplingParams):
    rid = engine.add_request(prompt, params)
    return drain(engine)[rid].outputs[0]
