"""Our GGUF-built tokenizer against transformers' tokenizer of the same file."""

from __future__ import annotations

import pytest

from kvpool.engine.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "line one\nline two\r\n\n\ttabbed",
    "numbers 0 7 42 1234567 3.14159 -12e10 1,000,000",
    "unicode: café naïve 日本語のテキスト 한국어 😀🚀👩‍👩‍👧",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "don't won't they're I'm we'll you'd",
    "",
    "ÀÉÎÕÜ ß ẞ Ω ≈ ∑ √ ∞ «quotes» — dash…",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with émoji 🎨"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(loaded, hf_tokenizer, text):
    tok = loaded.tokenizer
    ours = tok.encode(text, add_special_tokens=True)
    assert ours == hf_tokenizer(text, add_special_tokens=True).input_ids
    assert tok.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)
    assert tok.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(ours)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(loaded, hf_tokenizer, messages, add_generation_prompt):
    ours = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt
    )
    ref = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == ref


def test_special_ids_come_from_the_model(loaded):
    tok = loaded.tokenizer
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert tok.encode("<|im_end|>") == [2]


@pytest.mark.parametrize("text", TEXTS[3:6])
def test_incremental_detokenizer_streams_the_full_text_without_broken_characters(loaded, text):
    tok = loaded.tokenizer
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
