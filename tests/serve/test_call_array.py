"""The calls of tool_choice "required" are reported while they are generated, whatever the
whitespace and however the text is cut into deltas."""

from __future__ import annotations

import json

import pytest

from kvpool.serve.call_array import CallArrayScanner

ARRAY = ('[\n  {\n    "name": "get_weather",\n    "arguments": {"city": "Paris, \\"FR\\"", "days": [1, {"x": 2}]}\n  },'
         ' {"name":"add","arguments":{"a":1}}\n]')


def scan(pieces: list[str]) -> tuple[list[str], list[str], list[int]]:
    """Names, argument texts, and the number of events each delta produced."""
    scanner = CallArrayScanner()
    names: list[str] = []
    args: list[str] = []
    counts = []
    for p in pieces:
        events = scanner.feed(p)
        counts.append(len(events))
        for e in events:
            if e.name is not None:
                names.append(e.name)
                args.append("")
            else:
                args[e.index] += e.arguments
    return names, args, counts


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(ARRAY)])
def test_calls_and_arguments_come_out_the_same_however_the_text_is_cut(size):
    names, args, _ = scan([ARRAY[i:i + size] for i in range(0, len(ARRAY), size)])
    assert names == ["get_weather", "add"]
    assert [json.loads(a) for a in args] == [{"city": 'Paris, "FR"', "days": [1, {"x": 2}]}, {"a": 1}]


def test_the_name_is_reported_before_the_arguments_are_complete():
    text = '[{"name": "f", "arguments": {"q": "a long value'
    names, args, counts = scan([text[:20], text[20:]])
    assert names == ["f"] and args == ['{"q": "a long value']
    assert counts[1] >= 1  # the partial arguments already went out


def test_scalar_and_string_arguments_end_at_their_last_character():
    names, args, _ = scan(['[{"name":"n","arguments": 12', '5 }, {"name":"s","arguments":"x}"}]'])
    assert names == ["n", "s"] and args == ["125", '"x}"']
