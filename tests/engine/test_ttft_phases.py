"""Each request's time to first token by phase (`RequestMetrics.phases`, the server's TTFT
breakdown): every step that ran the request until its first token is counted once, none after,
and a prompt that arrives while others decode runs in the very next step."""

from __future__ import annotations

from engine_helpers import make_engine

from kvpool.sched.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def step_phases(m) -> float:
    p = m.phases
    return p.schedule + p.prefill_compute + p.sample + p.postprocess + p.detokenize


def first_records(engine, records: dict) -> None:
    """One step; each request's first record with a token is kept."""
    for r in engine.step():
        if r.outputs and r.outputs[0].token_ids:
            records.setdefault(r.request_id, r)


def test_a_chunked_prompt_counts_each_of_its_prefill_steps_once(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=32, num_blocks=64, max_model_len=256)
    engine.add_request(list(range(100, 200)), SamplingParams(max_tokens=4, **GREEDY), request_id="a")
    records: dict = {}
    steps = 0
    while engine.has_unfinished():
        first_records(engine, records)
        steps += 1
    m = records["a"].metrics
    assert steps == 4 + 3  # 100 prompt tokens in chunks of 32, 32, 32, 4; then three more tokens
    assert m.phases.steps == 4  # the decode steps after its first token are not its TTFT's
    assert all(v >= 0 for v in (m.phases.queued, m.phases.schedule, m.phases.prefill_compute, m.phases.sample,
                                m.phases.postprocess, m.phases.detokenize))
    assert m.phases.prefill_compute > 0
    assert m.arrival_s <= m.added_s <= m.first_scheduled_s <= m.first_token_time
    assert m.phases.queued + step_phases(m) <= m.first_token_time - m.added_s


def test_a_prompt_arriving_during_decodes_runs_in_the_very_next_step(loaded):
    engine = make_engine(loaded, num_blocks=64, max_model_len=256)
    engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=12, **GREEDY), request_id="a")
    records: dict = {}
    for _ in range(3):  # a's prefill and two decode steps
        first_records(engine, records)
    engine.add_request(list(range(500, 530)), SamplingParams(max_tokens=2, **GREEDY), request_id="b")
    first_records(engine, records)
    assert "b" in records  # its first token came from the first step after its arrival
    b = records["b"].metrics
    assert b.phases.steps == 1
    frozen = (b.phases.steps, step_phases(b))
    while engine.has_unfinished():
        first_records(engine, records)
    assert (b.phases.steps, step_phases(b)) == frozen  # its later steps are not added
    assert records["a"].metrics.phases.steps == 1


def test_a_first_token_is_handed_over_before_the_store_copies_the_prompts_blocks(loaded):
    engine = make_engine(loaded, num_blocks=64, max_model_len=256, kv_host_memory="32MiB")
    handed: list[tuple[list[str], int]] = []  # (request ids, blocks the store had saved then)

    def deliver(records) -> None:
        handed.append(([r.request_id for r in records], engine.kv_store.saved_blocks))

    engine.add_request(list(range(300, 340)), SamplingParams(max_tokens=3, **GREEDY), request_id="a")
    engine.add_request(list(range(600, 640)), SamplingParams(max_tokens=1, **GREEDY), request_id="done")
    returned = engine.step(deliver)
    assert handed == [(["a"], 0)]  # a's first token, before the step's blocks were copied out
    assert [r.request_id for r in returned] == ["done"]  # finished: after the copy (the P/D relay reads it next)
    assert engine.kv_store.saved_blocks == 4  # two full 16-token blocks of each prompt
    assert engine.step() and not handed[1:]  # without `deliver`, a step returns every record
