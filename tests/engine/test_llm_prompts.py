"""`LLM.generate` takes vLLM's prompt dicts and keyword; bad prompt forms are refused by name."""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import Engine
from kvpool.engine.llm import LLM
from kvpool.engine.prompts import Prompt, normalize_prompts
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import SamplingParams


def test_every_prompt_form_normalizes():
    assert normalize_prompts("hi") == [Prompt("hi")]
    assert normalize_prompts([1, 2, 3]) == [Prompt([1, 2, 3])]
    assert normalize_prompts({"prompt_token_ids": [4, 5]}) == [Prompt([4, 5])]
    assert normalize_prompts([{"prompt": "a", "cache_salt": "s"}, "b", [7]]) == [
        Prompt("a", "s"), Prompt("b"), Prompt([7])]


@pytest.mark.parametrize(("prompts", "param"), [
    ({"prompt": "a", "multi_modal_data": {}}, "multi_modal_data"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"prompt_token_ids": ["x"]}, "prompt_token_ids"),
    ([["a", 1]], "prompt_token_ids"),
    (42, "prompt"),
])
def test_bad_prompt_forms_name_the_field(prompts, param):
    with pytest.raises(InvalidRequest) as e:
        normalize_prompts(prompts)
    assert e.value.param == param


def test_guided_decoding_is_structured_outputs():
    p = SamplingParams.from_dict({"guided_decoding": {"choice": ["a", "b"]}, "max_tokens": 3})
    assert p.structured_outputs.choice == ["a", "b"]


def test_llm_generate_gives_dict_prompts_the_same_outputs(loaded):
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(num_blocks=64, max_model_len=256), loaded=loaded)
    llm.tokenizer = llm.engine.tokenizer
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    plain = llm.generate([text, ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)
    texts = [o.outputs[0].text for o in plain]
    assert texts[0] == texts[1]
    assert [o.outputs[0].text for o in dicts] == texts
