"""One validation station (kvpool/engine/input_processor.py): the same bad request sent to
`kvpool serve` over HTTP and given to the offline `LLM` is refused with the same message, naming
the same parameter. (The conductor's side: tests/cluster/test_one_front.py.)"""

from __future__ import annotations

import pytest
from conftest import KEYS

from kvpool.engine.config import EngineConfig
from kvpool.engine.llm import LLM
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams

BIG = 10**7  # no vocabulary's token id
# (the /v1/completions body, the same request's SamplingParams fields for LLM.generate)
BAD = [
    ({"prompt": [1, 2, 3], "max_tokens": 600}, {"max_tokens": 600}),  # over the context of 512
    ({"prompt": [1, 2, BIG], "max_tokens": 4}, {"max_tokens": 4}),
    ({"prompt": [1, -1], "max_tokens": 4, "echo": True}, {"max_tokens": 4}),  # no text to echo: refused, not a 500
    ({"prompt": [1, 2], "max_tokens": 4, "stop_token_ids": [BIG]}, {"max_tokens": 4, "stop_token_ids": [BIG]}),
    ({"prompt": [1, 2], "max_tokens": 4, "logit_bias": {str(BIG): 1.0}}, {"max_tokens": 4, "logit_bias": {BIG: 1.0}}),
    ({"prompt": [1, 2], "top_p": 0.0}, {"top_p": 0.0}),
    ({"prompt": [1, 2], "max_tokens": 4, "min_tokens": 9}, {"max_tokens": 4, "min_tokens": 9}),
    ({"prompt": [1, 2], "n": 17}, {"n": 17}),
]


@pytest.fixture(scope="module")
def llm(inprocess) -> LLM:
    """An offline LLM with the in-process server's limits, on its model already in memory."""
    _, state = inprocess
    return LLM.from_config(EngineConfig(num_blocks=128, max_model_len=512, max_num_seqs=32),
                           loaded=state.engine.engine.loaded)


def _llm_refusal(llm: LLM, body: dict, fields: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        llm.generate([body["prompt"]], SamplingParams(**fields), use_tqdm=False)
    return e.value


@pytest.mark.parametrize(("body", "fields"), BAD, ids=[str(sorted(b))[:60] for b, _ in BAD])
def test_a_bad_request_gets_the_same_error_from_serve_and_llm(inprocess, llm, body, fields):
    client, _ = inprocess
    r = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 400, r.text
    served = r.json()["error"]
    offline = _llm_refusal(llm, body, fields)
    assert (served["message"], served["param"]) == (str(offline), offline.param)
    assert not llm.engine.has_unfinished()
