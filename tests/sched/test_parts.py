"""The scheduler's parts stand on their own: each is built from the KV manager and the queues
alone (no Scheduler), and decides what the scheduler then carries out."""

from __future__ import annotations

from kvpool.core.kv_manager import KVCacheManager
from kvpool.sched.forks import Forks
from kvpool.sched.output import SchedulerOutput
from kvpool.sched.preemption import Preemption
from kvpool.sched.queues import Queues
from kvpool.sched.request import FinishReason, SeqStatus, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams
from kvpool.sched.stops import Stops


def _running(kv: KVCacheManager, queues: Queues, forks: Forks, rid: str, prompt: list[int]) -> SequenceGroup:
    seq = forks.new(prompt)
    group = SequenceGroup(rid, [seq], SamplingParams(max_tokens=8, ignore_eos=True), len(queues.running))
    kv.allocate(seq.seq_id, seq.token_ids)
    seq.num_computed_tokens, seq.status = len(prompt), SeqStatus.RUNNING
    seq.token_ids.append(7)  # the sampled token whose slot the next step needs
    queues.running.append(group)
    return group


def test_preemption_alone_takes_the_latest_arrived_group_whole_for_the_oldest():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    queues, forks = Queues(kv), Forks(kv)
    old = _running(kv, queues, forks, "old", [1] * 8)
    new = _running(kv, queues, forks, "new", [2] * 8)  # the pool is full: 2 + 2 blocks
    out = SchedulerOutput()
    preemption = Preemption(kv, queues, "recompute", watermark_blocks=0)
    assert preemption.reserve_decode_slots(old, old.live_seqs, out)
    assert out.preempted == [new] and list(queues.waiting) == [new] and queues.running == [old]
    assert new.seqs[0].status is SeqStatus.WAITING and not kv.has_seq(new.seqs[0].seq_id)
    assert kv.seq(old.seqs[0].seq_id).num_tokens == 9 and preemption.num_preemptions == 1


def test_stops_alone_finish_at_max_tokens_and_free_the_blocks():
    kv = KVCacheManager(8, 4)
    queues, forks = Queues(kv), Forks(kv)
    group = _running(kv, queues, forks, "r", [3] * 5)
    seq = group.seqs[0]
    seq.token_ids.pop()
    stops = Stops(kv)
    finished = [stops.append(group, seq, 9) for _ in range(8)]
    assert finished == [False] * 7 + [True]
    assert seq.finish_reason is FinishReason.LENGTH and not kv.has_seq(seq.seq_id)
    assert queues.free_finished() == [group] and not queues.running and kv.num_free_blocks == 8
