"""Request fields for retention (serve/retention_fields.py), on a character-level tokenizer
and template so the expected prefix lengths are plain string lengths."""

from __future__ import annotations

import pytest

from kvpool.core.retention import RetentionRequest
from kvpool.errors import InvalidRequest
from kvpool.serve.protocol import ChatMessage
from kvpool.serve.retention_fields import (
    chat_marks,
    chat_retention,
    completion_retention,
    parse_ttl,
    relayed,
)


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, **_) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _msgs(*raw) -> list[ChatMessage]:
    return [ChatMessage(**m) for m in raw]


def test_a_marked_content_part_covers_the_prompt_through_that_part():
    msgs = _msgs(
        {"role": "system", "content": [{"type": "text", "text": "tools"},
                                       {"type": "text", "text": "rules", "cache_control": {"type": "ephemeral"}},
                                       {"type": "text", "text": "today"}]},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    )
    marks = chat_marks(msgs)
    assert marks == [(0, 1, 300.0), (1, None, 3600.0)]
    got = chat_retention(CharTokenizer(), msgs, marks, {}, True, True)
    assert got == (RetentionRequest(len("<system>tools\nrules"), 300.0, 0),
                   RetentionRequest(len("<system>tools\nrules\ntoday</system><user>hi</user>"), 3600.0, 0))


def test_completions_retention_in_tokens_or_chars():
    tok = CharTokenizer()
    assert completion_retention(None, ["abc"], tok, True) == ()
    assert completion_retention({"prefix_chars": 2, "ttl": "30s", "priority": 7}, ["abcdef"], tok, True) == (
        RetentionRequest(2, 30.0, 7),)
    assert completion_retention({}, [[1, 2, 3], [4]], tok, True) == (RetentionRequest(None, 300.0, 0),)


@pytest.mark.parametrize("bad", ["5", "5d", "0s", "-1m", " 5m", 5, None, "61m", "2h"])
def test_a_request_ttl_is_an_int_with_a_unit_up_to_an_hour(bad):
    with pytest.raises(InvalidRequest) as e:
        parse_ttl(bad, "x.ttl")
    assert e.value.param == "x.ttl"


def test_a_pin_may_hold_up_to_a_week():
    assert parse_ttl("168h", "ttl", 7 * 24 * 3600.0) == 7 * 24 * 3600.0
    with pytest.raises(InvalidRequest):
        parse_ttl("169h", "ttl", 7 * 24 * 3600.0)


def test_more_than_four_breakpoints_are_refused():
    part = {"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(InvalidRequest) as e:
        chat_marks(_msgs({"role": "user", "content": [part] * 5}))
    assert e.value.param == "messages"


def test_a_relayed_retention_reads_back_the_same():
    tok = CharTokenizer()
    mine = (RetentionRequest(16, 300.0, 2), RetentionRequest(None, 3600.0, 0))
    assert completion_retention(relayed(mine), [[1] * 40], tok, True) == mine
    with pytest.raises(InvalidRequest) as e:
        completion_retention([{"ttl": "5m"}, {"ttl": "5x"}], [[1]], tok, True)
    assert e.value.param == "kvpool_retention[1].ttl"
    with pytest.raises(InvalidRequest) as e:
        completion_retention([{}] * 5, [[1]], tok, True)
    assert e.value.param == "kvpool_retention"
