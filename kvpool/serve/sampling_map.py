"""The request fields that steer sampling beyond temperature and top-p (penalties, logit_bias,
bad_words, best_of, structured output) turned into SamplingParams fields, for completions and
chat alike.

Types are checked by the request models (strict pydantic); what is checked here is what the
types cannot say: logit_bias keys that are token ids with biases in [-100, 100] (OpenAI's
range; refused rather than clamped), one output constraint per request, and best_of > n only
without streaming (as vLLM: the best n are known only once all finish). Whether an id is in
this model's vocabulary is the input processor's check (`engine/input_processor.py`).
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import InvalidRequest
from kvpool.sched.sampling_params import StructuredOutputs

BIAS_LIMIT = 100.0
# vLLM's structured_outputs keys kvpool implements; the others are refused unless neutral
_STRUCTURED_KEYS = frozenset({"json", "json_object", "regex", "choice", "grammar"})
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def check_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: string token-id keys, biases in [-100, 100]."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise InvalidRequest(f"logit_bias key {key[:32]!r} is not a token id", param="logit_bias")
        tok = int(key)
        if not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise InvalidRequest(f"logit_bias for token {tok} must be in [-100, 100], got {value}",
                                 param="logit_bias")
        out[tok] = float(value)
    return out


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON schema object",
                                 param="response_format")
        return {"json": schema}
    raise InvalidRequest(f"response_format type {str(kind)[:32]!r} is not supported (text, json_object, "
                         "json_schema)", param="response_format")


def compact_json(req: Any) -> bool:
    """vLLM's `structured_outputs.disable_any_whitespace`: compact JSON for whichever JSON
    constraint the request has (response_format, guided_json, a forced tool call)."""
    spec = req.structured_outputs or {}
    flag = spec.get("disable_any_whitespace", False)
    if not isinstance(flag, bool):
        raise InvalidRequest("structured_outputs.disable_any_whitespace must be a boolean",
                             param="structured_outputs")
    return flag


def _vllm_structured(spec: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in spec.items():
        if key == "disable_any_whitespace":
            continue  # a modifier of the constraint, not one (`compact_json`)
        if key in _STRUCTURED_KEYS:
            if value is not None:
                out[key] = value
        elif value not in (None, False, "", [], {}):
            raise InvalidRequest(f"structured_outputs.{key[:32]} is not supported by kvpool",
                                 param="structured_outputs")
    return out


def structured_outputs(req: Any) -> StructuredOutputs | None:
    """The one output constraint of response_format, guided_* or structured_outputs; more than one
    is refused (which would win is not obvious)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name, key in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if req.structured_outputs is not None:
        spec = _vllm_structured(req.structured_outputs)
        if spec:
            found.append(("structured_outputs", spec))
    if not found:
        return None
    if len(found) > 1 or len(found[0][1]) > 1:
        names = ", ".join(n for n, _ in found) if len(found) > 1 else ", ".join(found[0][1])
        raise InvalidRequest(f"give one output constraint, got {names}", param=found[-1][0])
    name, spec = found[0]
    try:
        return StructuredOutputs(**spec, disable_any_whitespace=compact_json(req))
    except InvalidRequest as e:
        raise InvalidRequest(f"{name}: {e}", param=name) from None


def control_params(req: Any) -> dict[str, Any]:
    """SamplingParams fields of the request's penalties, biases, bans, best_of and constraint."""
    if req.best_of is not None and req.best_of != req.n and req.stream:
        raise InvalidRequest("best_of > n cannot stream (the best n are known only when all finish)",
                             param="best_of")
    return {
        "presence_penalty": 0.0 if req.presence_penalty is None else req.presence_penalty,
        "frequency_penalty": 0.0 if req.frequency_penalty is None else req.frequency_penalty,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "logit_bias": check_logit_bias(req.logit_bias),
        "bad_words": list(req.bad_words or []),
        "best_of": req.best_of,
        "structured_outputs": structured_outputs(req),
    }


_NEUTRAL: dict[str, Any] = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                            "response_format": {"type": "text"}}
CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
                  "best_of", "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")


def set_controls(req: Any) -> list[str]:
    """The control fields a request sets to something other than off (for a relay that cannot
    honour them, e.g. the conductor's gateway, to refuse by name)."""
    names = []
    for name in CONTROL_FIELDS:
        value = getattr(req, name, None)
        if value is None or value in ([], {}) or (name == "best_of" and value == req.n):
            continue
        if name in _NEUTRAL and value == _NEUTRAL[name]:
            continue
        names.append(name)
    return names
