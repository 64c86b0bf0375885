"""Grammar-constrained decoding on the bundled vocabulary: whatever the logits, the text obeys the constraint."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvpool.engine.sampler import RowParams, sample
from kvpool.engine.structured import GrammarCompiler, choice_grammar
from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import StructuredOutputs

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                   "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(loaded) -> GrammarCompiler:
    return GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size)


def decode(compiler, tokenizer, specs, seed: int, max_steps: int = 200) -> list[str]:
    """Sample every spec's row together from random logits under the batched grammar mask."""
    matchers = [compiler.matcher(compiler.compile(s)) for s in specs]
    gen = torch.Generator().manual_seed(seed)
    params = [RowParams(temperature=1.0, generator=torch.Generator().manual_seed(seed + i)) for i in range(len(specs))]
    out: list[list[int]] = [[] for _ in specs]
    live = list(range(len(specs)))
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), compiler.vocab_size, generator=gen) * 3
        allowed = compiler.allowed([matchers[i] for i in live], logits.device)
        res = sample(logits, [params[i] for i in live], allowed=allowed)
        still = []
        for i, tok in zip(live, res.token_ids, strict=True):
            if tok not in compiler.stop_token_ids:
                out[i].append(tok)
            if not matchers[i].accept(tok):
                still.append(i)
        live = still
    assert not live, "a constrained sequence did not finish"
    return [tokenizer.decode(ids) for ids in out]


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_constraints_each_hold_for_their_own_row(compiler, loaded, seed):
    choices = ["yes", "no", "maybe so"]
    texts = decode(compiler, loaded.tokenizer, [
        StructuredOutputs(choice=choices),
        StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"),
        StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),  # random logits favour endless whitespace
        StructuredOutputs(grammar='root ::= "(" ("a" | "b")+ ")"'),
    ], seed, max_steps=300)
    assert texts[0] in choices
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[1])
    value = json.loads(texts[2])
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)
    assert re.fullmatch(r"\((a|b)+\)", texts[3])


def test_unconstrained_rows_keep_every_token(compiler):
    m = compiler.matcher(compiler.compile(StructuredOutputs(choice=["x"])))
    allowed = compiler.allowed([None, m, None], torch.device("cpu"))
    assert allowed.shape == (3, compiler.vocab_size)
    assert allowed[0].all() and allowed[2].all()
    assert 0 < int(allowed[1].sum()) < 10


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


@pytest.mark.parametrize("spec", [
    StructuredOutputs(regex="(unclosed"),
    StructuredOutputs(grammar="root ::= missing_rule"),
    StructuredOutputs(json='{"type": "objec'),
])
def test_a_constraint_that_does_not_compile_is_an_invalid_request(compiler, spec):
    with pytest.raises(InvalidRequest, match="does not compile"):
        compiler.compile(spec)
