"""Per-request sampling state the scheduler does not keep: each sample's generator (seed +
sample index), grammar matchers, bad words as token ids, prompt logprobs, and best_of's
choice of outputs.

The input processor calls `prepare` while it validates a request (a grammar that does not
compile is refused there); the engine calls `add` when the request is queued, `row_params` /
`allowed` / `accept` around each sampling call, `record_prompt` after each forward pass, and
`forget` when the request leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpool.engine.sampler import RowParams, bad_word_bans
from kvpool.engine.structured import GrammarCompiler, GrammarMatcher
from kvpool.sched.request import Sequence, SequenceGroup
from kvpool.sched.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    bad_words: list[list[int]] = field(default_factory=list)
    grammar: object | None = None  # compiled; each sequence gets its own matcher
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    prompt_num_top: int = 0
    matchers: dict[int, GrammarMatcher] = field(default_factory=dict)  # seq id -> its grammar position
    generators: list[torch.Generator] | None = None  # sample i draws with seed + i (seeded requests)


class Controls:
    def __init__(self, tokenizer, vocab_size: int, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self._compiler: GrammarCompiler | None = None
        self._requests: dict[str, RequestState] = {}

    # -- requests ------------------------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> RequestState:
        """The state of validated `params`: bad words as token ids, the compiled grammar (raises
        InvalidRequest if it does not compile), prompt logprobs, seeded generators."""
        state = RequestState()
        for word in params.bad_words:  # as vLLM: the word alone and after a space
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in state.bad_words:
                    state.bad_words.append(ids)
        if params.structured_outputs is not None:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            state.grammar = self._compiler.compile(params.structured_outputs)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs, state.prompt_top = [None], [[]]
            state.prompt_num_top = params.prompt_logprobs
        if params.seed is not None and not params.use_beam_search:
            state.generators = [torch.Generator(device=self.device).manual_seed(params.seed + i)
                                for i in range(params.num_samples)]
        return state

    @property
    def constrained(self) -> bool:
        """Has any request had a grammar (else `accept` need not be asked)?"""
        return self._compiler is not None

    def add(self, request_id: str, state: RequestState) -> None:
        self._requests[request_id] = state

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # -- sampling ------------------------------------------------------------------------------
    def row_params(self, g: SequenceGroup, seq: Sequence, sample_index: int) -> RowParams:
        """Sample `sample_index` of `seq`'s row (a first row's later samples become forks)."""
        p = g.params
        state = self._requests.get(g.request_id)
        generator = state.generators[sample_index] if state is not None and state.generators is not None else None
        output = seq.output_ids
        banned = bad_word_bans(state.bad_words, output) if state and state.bad_words else ()
        return RowParams(
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, generator=generator,
            num_logprobs=p.logprobs or 0, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            logit_bias=p.logit_bias, banned_token_ids=banned,
            prompt_ids=seq.token_ids[: seq.prompt_len] if p.repetition_penalty != 1 else (),
            output_ids=output if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 else (),
        )

    def allowed(self, targets: list[tuple[SequenceGroup, Sequence]], device: torch.device) -> torch.Tensor | None:
        """One grammar mask for the sampled rows (None when no row is constrained)."""
        if self._compiler is None:
            return None
        matchers = [self._matcher(g, seq) for g, seq in targets]
        return self._compiler.allowed(matchers, device) if any(m is not None for m in matchers) else None

    def accept(self, g: SequenceGroup, seq: Sequence, token: int) -> bool:
        """Advance the sequence's grammar; True when the grammar is done (stop the sequence)."""
        m = self._matcher(g, seq)
        return m is not None and m.accept(token)

    def _matcher(self, g: SequenceGroup, seq: Sequence) -> GrammarMatcher | None:
        state = self._requests.get(g.request_id)
        if state is None or state.grammar is None:
            return None
        m = state.matchers.get(seq.seq_id)
        if m is None:  # forks happen before the first token, so every sequence starts at the root
            m = state.matchers[seq.seq_id] = self._compiler.matcher(state.grammar)
        return m

    # -- prompt logprobs -----------------------------------------------------------------------
    def record_prompt(self, scheduled, runner) -> None:
        """Score the prompt positions this step computed for requests that asked, once each
        (a recompute after preemption does not score them again)."""
        rows, next_ids, owners = [], [], []
        offset = 0
        for s in scheduled:
            g, seq = s.group, s.seq
            state = self._requests.get(g.request_id)
            end = s.start + s.num_new_tokens
            if state is not None and state.prompt_logprobs is not None and seq is g.seqs[0]:
                # row j predicts token j + 1; positions before len(prompt_logprobs) - 1 are done
                for j in range(max(s.start, len(state.prompt_logprobs) - 1), min(end, seq.prompt_len - 1)):
                    rows.append(offset + j - s.start)
                    next_ids.append(seq.token_ids[j + 1])
                    owners.append(state)
            offset += s.num_new_tokens
        if not rows:
            return
        chosen, tops = runner.token_logprobs(rows, next_ids, max(o.prompt_num_top for o in owners))
        for state, lp, top in zip(owners, chosen, tops, strict=True):
            state.prompt_logprobs.append(lp)
            state.prompt_top.append(top[: state.prompt_num_top])

    def prompt_result(self, request_id: str):
        state = self._requests.get(request_id)
        if state is None or state.prompt_logprobs is None:
            return None, None
        return list(state.prompt_logprobs), list(state.prompt_top)


def best_of(group: SequenceGroup) -> list[Sequence]:
    """The n of best_of sequences with the highest cumulative logprob, best first."""
    seqs = sorted(group.seqs, key=lambda s: s.sample_index)
    return sorted(seqs, key=lambda s: -s.cumulative_logprob)[: group.params.n]
