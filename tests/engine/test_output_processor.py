"""The output processor over the real scheduler with a stand-in tokenizer (a token is a fixed
string): each step reports only what is new, stop strings never show in any delta and stop the
sequence in the core, and a long stream's per-step work is counted, not timed, to be O(new)."""

from __future__ import annotations

from kvpool.engine.output_processor import OutputProcessor
from kvpool.engine.outputs import FinishedOutputs, RequestMetrics, RequestOutput
from kvpool.sched.output import Sample
from kvpool.sched.request import SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.scheduler import Scheduler, SchedulerConfig

EOS = 0
PIECES = ["<eos>", "a", "b", "c", "E", "N", "D", " ", "xy", "END!"]  # token id -> its text


class Pieces:
    """A tokenizer whose token i is PIECES[i] (the eos token is special); counts what it decodes."""

    def __init__(self) -> None:
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded_ids += len(ids)
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == EOS))


class Driver:
    """Plays the engine's step: schedule, "sample" the next scripted token, postprocess, then the
    output processor's two calls with the core's stop in between (kvpool/engine/engine.py)."""

    def __init__(self) -> None:
        self.sched = Scheduler(SchedulerConfig(num_blocks=1024, block_size=4, max_model_len=4096))
        self.tok = Pieces()
        self.outputs = OutputProcessor(self.tok)
        self.scripts: dict[str, list[list[int]]] = {}

    def add(self, rid: str, params: SamplingParams, *scripts: list[int]) -> None:
        """`scripts[j]` is the tokens sample j draws, in order."""
        g = SequenceGroup(rid, [self.sched.new_sequence([1, 2, 3])], params, 0.0, eos_token_ids=(EOS,))
        self.sched.add_request(g)
        self.outputs.add(g, None, RequestMetrics(rid, 0.0, 3))
        self.scripts[rid] = [list(s) for s in scripts]

    def step(self) -> list[RequestOutput]:
        out = self.sched.schedule()
        sampled = []
        for s in out.sampling:
            scripts = self.scripts[s.group.request_id]
            first = s.seq.sample_index
            sampled.append(Sample([scripts[first + j].pop(0) for j in range(s.num_samples)], [-0.5] * s.num_samples))
        finished = {g.request_id for g in self.sched.postprocess(out, sampled)}
        groups = list({s.group.request_id: s.group for s in out.sampling}.values())
        hits, failed = self.outputs.detokenize(groups)
        assert not failed
        finished |= {g.request_id for g in self.sched.stop_at_strings(hits)}
        records = [self.outputs.emit(g, g.request_id in finished, None, 1.0, lambda _: (None, None)) for g in groups]
        return [r for r in records if r is not None]

    def run(self) -> tuple[list[RequestOutput], dict[str, RequestOutput]]:
        records, whole = [], FinishedOutputs()
        done = {}
        while self.sched.has_unfinished():
            step = self.step()
            records += step
            done.update({o.request_id: o for o in whole.add(step)})
        return records, done


def test_a_stop_string_split_across_tokens_never_shows_and_stops_in_the_core():
    d = Driver()
    d.add("r", SamplingParams(max_tokens=20, stop=["END"]), [1, 2, 4, 5, 6, 3, 3])  # a b E N D ...
    records, done = d.run()
    texts = [c.text for r in records for c in r.outputs]
    assert "".join(texts) == "ab" and all("E" not in t for t in texts)
    out = done["r"].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", "END", [1, 2, 4, 5, 6])
    assert d.sched.kv.num_free_blocks == d.sched.kv.pool.num_blocks  # the core freed it


def test_held_text_is_released_when_no_stop_string_follows():
    d = Driver()
    d.add("r", SamplingParams(max_tokens=4, stop=["END"]), [1, 4, 5, 2])  # a E N b: "EN" was held, then "b"
    records, done = d.run()
    texts = [r.outputs[0].text for r in records]
    assert texts == ["", "", "a", "ENb"]  # two characters held back until the finish
    assert done["r"].outputs[0].text == "aENb" and done["r"].outputs[0].finish_reason == "length"


def test_a_stop_string_on_the_last_allowed_token_is_a_stop_not_the_length_limit():
    d = Driver()
    d.add("r", SamplingParams(max_tokens=3, stop=["END"], include_stop_str_in_output=True), [1, 7, 9])  # a, " ", END!
    _, done = d.run()
    out = done["r"].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a END", "stop", "END")


def test_eos_is_no_part_of_the_text_but_a_stop_token_id_is():
    d = Driver()
    d.add("eos", SamplingParams(max_tokens=9, skip_special_tokens=False), [1, EOS])
    d.add("tok", SamplingParams(max_tokens=9, stop_token_ids=[2]), [1, 2])
    _, done = d.run()
    assert done["eos"].outputs[0].text == "a" and done["eos"].outputs[0].token_ids == [1, EOS]
    assert done["tok"].outputs[0].text == "ab" and done["tok"].outputs[0].stop_reason == 2


def test_n_samples_each_report_their_own_deltas():
    d = Driver()
    d.add("r", SamplingParams(n=2, max_tokens=3, seed=0), [1, 2, 3], [3, EOS])  # the second stops a step earlier
    records, done = d.run()
    assert [[c.index for c in r.outputs] for r in records] == [[0, 1], [0, 1], [0]]
    outs = done["r"].outputs
    assert [(o.text, o.finish_reason) for o in outs] == [("abc", "length"), ("c", "stop")]
    assert outs[0].logprobs is None and outs[0].cumulative_logprob == -1.5


def test_a_long_streams_per_step_output_work_is_constant():
    """O(new tokens) per step, counted: every delta holds exactly the step's one new token, the
    characters copied and the token ids decoded per step are the same at step 3000 as at step 10
    (the old cumulative outputs copied every earlier token and character again each step)."""
    n = 3000
    d = Driver()
    d.add("r", SamplingParams(max_tokens=n, stop=["ENDS"], ignore_eos=True), [8] * n)  # "xy" each step
    per_step = []
    for _ in range(n):
        chars, ids = d.outputs.num_chars, d.tok.decoded_ids
        (record,) = d.step()
        (c,) = record.outputs
        assert len(c.token_ids) == 1
        per_step.append((d.outputs.num_chars - chars, d.tok.decoded_ids - ids, len(c.text)))
    assert record.finished
    assert set(per_step[10:-1]) == {per_step[10]} and per_step[10] == (4, per_step[10][1], 2)
    assert per_step[10][1] <= 16  # a window of a few tokens, however long the text
