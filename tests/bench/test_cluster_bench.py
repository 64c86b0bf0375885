"""`kvpool bench cluster policies` sends the simulator's documents workload to the real cluster."""

from kvpool.bench.cluster import document_prompts
from kvpool.sim.experiments.conductor_policies import DocumentsWorkload
from kvpool.sim.workloads import SYNTHETIC_CHUNK_BASE


def test_real_prompts_have_the_simulated_block_layout_and_document_choice():
    w = DocumentsWorkload(documents=3, requests=20)
    arrivals, which = w.draws()
    prompts = document_prompts(w, which)
    sim = w.sim_requests()
    assert [r.arrival_s for r in sim] == arrivals.tolist()
    assert all(len(p) == r.prompt_len == w.doc_tokens + w.question_tokens for p, r in zip(prompts, sim, strict=True))
    docs = {}
    for p, r, d in zip(prompts, sim, which, strict=True):
        assert r.chunks[0] == (SYNTHETIC_CHUNK_BASE + int(d), w.doc_tokens)  # the simulator's document d
        docs.setdefault(int(d), p[: w.doc_tokens])
        assert p[: w.doc_tokens] == docs[int(d)]  # one document, token for token
    assert len({tuple(v) for v in docs.values()}) == len(docs)  # distinct documents
    assert len({tuple(p[w.doc_tokens:]) for p in prompts}) == len(prompts)  # each question its own
