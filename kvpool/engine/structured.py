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
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

import torch
from torch import Tensor

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import StructuredOutputs

logger = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)
_LOG_PREFIX = re.compile(r"^\[[0-9:. ]+\]\s*\S+:\d+:\s*")


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


def library_message(error: Exception) -> str:
    """xgrammar's message without its C++ log prefix (`[hh:mm:ss] /path/file.cc:123: `) or
    anything after the first line: a client learns what is wrong, not how the server is built."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return _LOG_PREFIX.sub("", lines[0]).strip()[:300]


def schema_text(schema: dict | str) -> str:
    """The schema as JSON text, once every `$ref` in it is known to resolve inside it: xgrammar
    fetches nothing and would otherwise leave a remote reference unconstrained."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"structured output json does not compile: not valid JSON ({e})",
                                 param="json") from None
    else:
        parsed = schema
    check_refs(parsed)
    return schema if isinstance(schema, str) else json.dumps(schema)


def check_refs(root: Any) -> None:
    """Every `$ref` must be a JSON pointer (`#` or `#/...`) to a part of the same schema."""
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if ref is not None:
            _resolve(root, ref)
        stack.extend(node.values())


def _resolve(root: Any, ref: Any) -> None:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise InvalidRequest(f"json schema $ref {str(ref)[:100]!r} is not a reference inside the schema "
                             "(kvpool fetches no remote or relative schemas: inline it under $defs and "
                             "refer to it as #/$defs/NAME)", param="json")
    node = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise InvalidRequest(f"json schema $ref {ref[:100]!r} points to nothing in the schema", param="json")


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
        """The compiled grammar; a schema, regex or grammar the library rejects is an InvalidRequest.
        JSON allows any whitespace between tokens (xgrammar's and vLLM's default) unless the spec
        asks for compact JSON (`disable_any_whitespace`)."""
        c = self._compiler
        any_ws = not spec.disable_any_whitespace
        try:
            match spec.kind:
                case "json":
                    schema = schema_text(spec.json)
                    return c.compile_json_schema(schema, any_whitespace=any_ws)
                case "json_object":  # an object, as OpenAI's json_object and vLLM's xgrammar backend
                    return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
                case "regex":
                    return c.compile_regex(spec.regex)
                case "choice":
                    return c.compile_grammar(choice_grammar(spec.choice))
                case _:
                    return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"structured output {spec.kind} does not compile: {library_message(e)}",
                                 param=spec.kind) from None

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
