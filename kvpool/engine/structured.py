"""Grammar-constrained decoding (structured outputs) through xgrammar.

A request's constraint (JSON schema, any JSON object, regex, choice or EBNF grammar) is
compiled once per engine (xgrammar caches compiled grammars) into a matcher per sequence.
Each step fills one packed bitmask for every constrained row in one library call, unpacks it
with one tensor op and hands the sampler a bool [N, V] mask; the sampled tokens then advance
the matchers. A sequence whose grammar has terminated (accepted a stop token) or can accept
nothing more finishes with "stop".

xgrammar was picked over llguidance and outlines-core by measuring the mask per step on the
bundled vocabulary (49,152 tokens): see docs/structured_outputs.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


def _xgrammar():
    """Imported on first use: it pulls in transformers (about a second), which plain serving never needs."""
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise InvalidRequest(f"structured outputs need the xgrammar package ({e})", param="structured_outputs") from e
    return xgrammar


def _vocab_type(tokenizer_json: dict[str, Any], xg) -> tuple[Any, bool]:
    """How token strings map to bytes (byte-level BPE, SentencePiece byte fallback, or raw)."""
    text = json.dumps(tokenizer_json.get("decoder") or {})
    if "ByteLevel" in text:
        return xg.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in text:
        return xg.VocabType.BYTE_FALLBACK, True
    return xg.VocabType.RAW, False


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root is exactly one of the choices (JSON string escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; built lazily on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xg = self._xg = _xgrammar()
        fast = tokenizer.fast
        encoded = [""] * fast.get_vocab_size(with_added_tokens=True)
        for text, i in fast.get_vocab(with_added_tokens=True).items():
            encoded[i] = text
        for i, added in fast.get_added_tokens_decoder().items():
            if added.special:
                encoded[i] = ""  # xgrammar never allows an empty token inside a grammar
        vocab_type, prefix_space = _vocab_type(json.loads(fast.to_str()), xg)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(tokenizer.eos_token_ids)
        info = xg.TokenizerInfo(
            encoded[:vocab_size], vocab_type, vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids, add_prefix_space=prefix_space,
        )
        self._compiler = xg.GrammarCompiler(info, max_threads=1)
        self._batch = xg.BatchGrammarMatcher(max_threads=1)

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar; a schema, regex or grammar the library rejects is an InvalidRequest."""
        c = self._compiler
        try:
            match spec.kind:
                case "json":
                    schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                    return c.compile_json_schema(schema, any_whitespace=False)
                case "json_object":
                    return c.compile_builtin_json_grammar()
                case "regex":
                    return c.compile_regex(spec.regex)
                case "choice":
                    return c.compile_grammar(choice_grammar(spec.choice))
                case _:
                    return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"structured output {spec.kind} does not compile: {e}", param=spec.kind) from e

    def matcher(self, compiled) -> GrammarMatcher:
        return GrammarMatcher(self._xg.GrammarMatcher(compiled))

    def allowed(self, matchers: Sequence[GrammarMatcher | None], device: torch.device) -> Tensor | None:
        """bool [N, V]: True where row i may take the token (every token for unconstrained rows)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        self._batch.batch_fill_next_token_bitmask(
            [matchers[i].inner for i in rows], bitmask, rows
        )
        bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
        return bits.view(len(matchers), -1)[:, : self.vocab_size].bool().to(device)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("inner",)

    def __init__(self, inner) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; True when the grammar is done (the sequence must stop)."""
        if not self.inner.accept_token(token_id):
            # the mask allowed it, so only a stop token the grammar did not list gets here
            logger.debug("grammar refused token %d; ending the sequence", token_id)
            return True
        return self.inner.is_terminated()
