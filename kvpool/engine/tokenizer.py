"""Tokenizer over the `tokenizers` library, built from an HF tokenizer.json or GGUF metadata,
with the model's own chat template (jinja2) and a streaming detokenizer.

Serving never imports transformers: a GGUF vocabulary is turned into a `tokenizers` model here,
a byte-level BPE (`gpt2`) or a SentencePiece BPE with byte fallback (`llama`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer

from kvpool.errors import ConfigError, InvalidRequest

logger = logging.getLogger(__name__)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF `tokenizer.ggml.pre` -> regex split applied before byte-level BPE (None: GPT-2's own).
_GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
_GGUF_TOKENIZER_KEYS = frozenset(
    "tokenizer.ggml." + key
    for key in (  # noqa: SIM905 (a list literal would be 30 lines)
        "model pre tokens scores token_type merges add_bos_token add_eos_token add_sep_token "
        "add_space_prefix remove_extra_whitespaces bos_token_id eos_token_id unknown_token_id "
        "padding_token_id seperator_token_id separator_token_id cls_token_id mask_token_id "
        "eot_token_id eom_token_id prefix_token_id suffix_token_id middle_token_id "
        "fim_pre_token_id fim_suf_token_id fim_mid_token_id fim_pad_token_id fim_rep_token_id "
        "fim_sep_token_id"
    ).split()
)  # ids of tokens encoding never inserts (eot, fim, ...) do not change what it computes


class Tokenizer:
    """Encode/decode, special ids and chat formatting for one model."""

    def __init__(
        self,
        fast: FastTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self.fast = fast
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render messages with the model's own jinja template, as transformers does."""
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template; use a plain completion")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **extra,
        )

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.fast.id_to_token(token_id) or "")

    @cached_property
    def _template(self) -> Any:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        )  # transformers' signature: tool-calling templates pass separators and sort_keys
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(self.chat_template)

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: Sequence[int]) -> Tokenizer:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{file} not found; an HF model directory needs tokenizer.json")
        fast = FastTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = hf_chat_template(path, cfg)
        bos = _token_id(fast, cfg.get("bos_token"))
        if not eos_token_ids:
            eos = _token_id(fast, cfg.get("eos_token"))
            eos_token_ids = () if eos is None else (eos,)
        return cls(fast, eos_token_ids, bos, template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], eos_token_ids: Sequence[int]) -> Tokenizer:
        """`tokenizer.ggml.*` as a fast tokenizer; control tokens become special added tokens,
        user-defined ones plain added tokens (both matched whole, as llama.cpp does)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        for key in meta:
            named_template = key.startswith("tokenizer.chat_template")
            if key.startswith("tokenizer.") and key not in _GGUF_TOKENIZER_KEYS and not named_template:
                raise ConfigError(f"GGUF metadata {key} is not implemented by the tokenizer")
        for key in ("add_eos_token", "add_sep_token", "remove_extra_whitespaces"):
            if meta.get(f"tokenizer.ggml.{key}", False):
                raise ConfigError(f"GGUF tokenizer.ggml.{key}=True unsupported")
        if kind == "gpt2":
            fast = _byte_level_bpe(meta, tokens)
        elif kind == "llama":
            # Gemma files spell tokens made of spaces with real spaces; the text side uses U+2581.
            tokens = [_SPACE * len(t) if t and set(t) == {" "} else t for t in tokens]
            fast = _sentencepiece_bpe(meta, tokens, types)
        else:
            raise ConfigError(
                f"GGUF tokenizer.ggml.model={kind!r} unsupported; use 'gpt2' (byte-level BPE) or "
                "'llama' (SentencePiece BPE)"
            )
        fast.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL
            ]
        )
        fast.add_tokens(
            [
                AddedToken(t, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token", kind == "llama"):
            fast.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A $B",
                special_tokens=[(tokens[bos], bos)],
            )
        return cls(fast, eos_token_ids, bos, meta.get("tokenizer.chat_template"))


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> FastTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    fast = FastTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama3", "llama-bpe"))
    )
    split = _GGUF_SPLITS.get(pre)
    if split is not None:
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # GPT-2 split, digits one by one
        fast.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    return fast


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> FastTokenizer:
    """SentencePiece BPE: spaces are U+2581, characters missing from the vocabulary fall back to
    <0xXX> byte tokens. GGUF stores no merges, so every split of a normal or user-defined token
    into two vocabulary pieces becomes a merge, ranked by the token's place in the vocabulary
    (SentencePiece orders pieces best first; Gemma's scores rank its whitespace runs last,
    which llama.cpp matches whole, so the place is the rank that agrees with both)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[int, int, int, str, str]] = []
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty not in (_NORMAL, _USER_DEFINED):
            continue
        for cut in range(1, len(tok)):
            left, right = vocab.get(tok[:cut]), vocab.get(tok[cut:])
            if left is not None and right is not None:
                ranked.append((i, left, right, tok[:cut], tok[cut:]))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    fast = FastTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(r[3], r[4]) for r in ranked],
            unk_token=None if unk is None else tokens[unk],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    fast.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    fast.decoder = decoders.Sequence(steps)
    return fast


def hf_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The directory's chat template where transformers looks for it, first found wins:
    `chat_template.jinja` (what current save_pretrained writes), `chat_template.json`
    (`{"chat_template": ...}`), then tokenizer_config.json's `chat_template`."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    legacy = path / "chat_template.json"
    if legacy.is_file():
        try:
            template = json.loads(legacy.read_text()).get("chat_template")
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"{legacy} is not a JSON object with a chat_template: {e}") from None
    else:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"the chat template in {path} is not text")
    return template


def _token_id(fast: FastTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else fast.token_to_id(token)


def _raise_template_error(message: str) -> None:
    raise InvalidRequest(f"chat template rejected the messages: {message}")


class IncrementalDetokenizer:
    """Turns newly generated ids into newly printable text for streaming.

    Decodes a short window of preceding tokens with the new ones and emits only the text past the
    window, so word-boundary spaces come out right; holds text back while it ends in an
    incomplete UTF-8 character (U+FFFD).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 6, 0)

    def step(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
