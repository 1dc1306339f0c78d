"""The router's and the policy's performance cuts answer as the code before them.

Each cut function is compared, on generated inputs (hypothesis), with the
form it replaced, kept here as it was: an id's check (one regex, not a
character set), a spend log's record (the newest slot found without a
search), a freed slot's subject (a prefix, not ``subject_matches``), a cost
estimate (0.0 at a free backend without estimating tokens) and the check of
a request's free-form params (skipped when it has none).
"""

from __future__ import annotations

import bisect
import math
import string
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.errors import MalformedRequestError
from renqueue.policy import _routing, _spend
from renqueue.policy._spend import Slot, SpendLog, record
from renqueue.policy._tokens import DEFAULT_MAX_TOKENS, estimate_input_tokens
from renqueue.schema import (
    MAX_JSON_DEPTH,
    RESERVED_EXTRA,
    ChatMessage,
    GenerationParams,
    InferenceRequest,
    capacity_subject,
    subject_matches,
    too_deep,
)
from renqueue.services.router._admission import _is_id
from renqueue.services.router._round import freed_backend

# ------------------------------------------------------------------ the old forms

_OLD_ID_OK = frozenset(string.ascii_letters + string.digits + "-_")


def _old_is_id(text: str) -> bool:
    return 0 < len(text) <= 128 and all(ch in _OLD_ID_OK for ch in text)


def _old_record(log: SpendLog, at: float, *, requests: int = 0, tokens: int = 0) -> SpendLog:
    """``record`` as it was: the slot always found by a search."""
    if not math.isfinite(at):
        return log
    newest = max(log.newest, at)
    requests, tokens = max(requests, 0), max(tokens, 0)
    ages_at = log.ages_at
    if newest >= ages_at:
        if any(_spend._ages_out(slot, newest) for slot in log.slots):
            merged: dict[tuple[float, float], list[int]] = {}
            for slot in log.slots:
                _spend._add(
                    merged, slot.start, slot.end, newest, requests=slot.requests, tokens=slot.tokens
                )
            if requests or tokens:
                _spend._add(merged, at, at, newest, requests=requests, tokens=tokens)
            slots = tuple(
                Slot(start, length, r, t) for (start, length), (r, t) in sorted(merged.items())
            )
            return SpendLog(slots=slots, newest=newest, ages_at=_spend._ages_at(slots))
        ages_at = _spend._ages_at(log.slots)
    length = _spend._resolution(newest - at)
    if length is None or not (requests or tokens):
        if newest == log.newest and ages_at == log.ages_at:
            return log
        return SpendLog(slots=log.slots, newest=newest, ages_at=ages_at)
    start = _spend._slot_of(at, length)
    index = bisect.bisect_left(log.slots, (start, length), key=_spend._key)
    updated = list(log.slots)
    if index < len(updated) and _spend._key(updated[index]) == (start, length):
        slot = updated[index]
        updated[index] = Slot(start, length, slot.requests + requests, slot.tokens + tokens)
    else:
        slot = Slot(start, length, requests, tokens)
        updated.insert(index, slot)
        ages_at = min(ages_at, _spend._aging(slot)) if ages_at else _spend._aging(slot)
    return SpendLog(slots=tuple(updated), newest=newest, ages_at=ages_at)


def _old_freed_backend(subject: str) -> str | None:
    if not subject_matches(capacity_subject("*"), subject):
        return None
    return subject.rsplit(".", 1)[-1]


class _Backend(msgspec.Struct, frozen=True):
    cost_input_per_mtok: float
    cost_output_per_mtok: float


def _old_estimated_cost(request: InferenceRequest, backend: _Backend) -> float:
    prompt = estimate_input_tokens(request)
    output = request.params.max_tokens or DEFAULT_MAX_TOKENS
    return (
        prompt * backend.cost_input_per_mtok + output * backend.cost_output_per_mtok
    ) / 1_000_000


def _old_check_params(request: InferenceRequest) -> None:
    params = request.params
    reserved = sorted(key for key in params.extra if key in RESERVED_EXTRA)
    if reserved:
        raise MalformedRequestError("reserved", request_id=request.id)
    known = sorted(key for key in params.extra if key in GenerationParams.__struct_fields__)
    if known:
        raise MalformedRequestError("known", request_id=request.id)
    schema = params.response_format.json_schema if params.response_format else None
    nested = [
        params.extra,
        *(t.parameters for t in params.tools),
        schema.schema if schema else None,
    ]
    if any(too_deep(value) for value in nested):
        raise MalformedRequestError(f"deeper than {MAX_JSON_DEPTH}", request_id=request.id)


# ------------------------------------------------------------------ ids

_ID_CHARS = st.sampled_from(
    [*string.ascii_letters, *string.digits, "-", "_", "\n", " ", ".", ":", "é", "٣", "ß", "\u212a"]
)


@settings(max_examples=500)
@given(st.one_of(st.text(_ID_CHARS, max_size=130), st.text(max_size=20)))
def test_an_id_is_checked_as_before(text: str) -> None:
    assert _is_id(text) == _old_is_id(text)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("abc\n", False),  # `$` would match before a final newline: fullmatch does not
        ("٣", False),  # a unicode digit: \d would take it
        ("é", False),  # a unicode letter: \w would take it
        ("\u212a", False),  # KELVIN SIGN: a case-insensitive [a-z] would take it
        ("A-z_09", True),
    ],
)
def test_an_id_edge(text: str, ok: bool) -> None:
    assert _is_id(text) is ok is _old_is_id(text)


# ------------------------------------------------------------------ spend log

_BASE = 1_700_000_000.0
_TIMES = st.one_of(
    # Out of order, equal, on and around slot boundaries (seconds, minutes,
    # hours), and far behind the newest (coarsened, or not kept).
    st.floats(min_value=-60.0, max_value=60.0).map(lambda d: _BASE + d),
    st.integers(min_value=-200_000, max_value=4000).map(lambda d: _BASE + d),
    st.integers(min_value=-60, max_value=60).map(lambda m: _BASE + 60.0 * m),
    st.integers(min_value=-60, max_value=60).map(lambda h: _BASE + 3600.0 * h),
    st.integers(min_value=-60, max_value=60).map(lambda h: math.nextafter(_BASE + 3600.0 * h, 0)),
    st.sampled_from([math.inf, math.nan, _BASE]),
)


@settings(max_examples=400)
@given(
    st.lists(
        st.tuples(_TIMES, st.integers(min_value=-1, max_value=3), st.integers(-5, 50)),
        max_size=40,
    )
)
def test_a_spend_is_recorded_as_before(spends: list[tuple[float, int, int]]) -> None:
    new = old = SpendLog()
    for at, requests, tokens in spends:
        new = record(new, at, requests=requests, tokens=tokens)
        old = _old_record(old, at, requests=requests, tokens=tokens)
        assert new == old


# ------------------------------------------------------------------ freed slots

_TOKENS = st.sampled_from(["rq", "capacity", "b", "gpu-1", "", "*", ">", "t1", "capacityx"])


@settings(max_examples=500)
@given(st.lists(_TOKENS, max_size=5).map(".".join))
def test_a_freed_slot_subject_is_judged_as_before(subject: str) -> None:
    assert freed_backend(subject) == _old_freed_backend(subject)


@pytest.mark.parametrize(
    "subject",
    [
        "rq.capacity.b",
        "rq.capacity.b.extra",  # a token more
        "rq.capacity",
        "rq.capacity.",
        "rq.capacity.*",
        "rq.capacity.>",
        "rq.t1.capacity.b",  # a tenant's subject
        "rq.capacityx.b",
        "xrq.capacity.b",
    ],
)
def test_a_freed_slot_subject_edge(subject: str) -> None:
    assert freed_backend(subject) == _old_freed_backend(subject)


# ------------------------------------------------------------------ cost, params

_JSON = st.recursive(
    st.none() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=40,
)


def _deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


_EXTRA = st.dictionaries(
    st.sampled_from([*sorted(RESERVED_EXTRA)[:3], "max_tokens", "seed", "custom", "x"]),
    st.one_of(_JSON, st.just(_deep(MAX_JSON_DEPTH + 1))),
    max_size=3,
)


@st.composite
def _requests(draw: st.DrawFn) -> InferenceRequest:
    tools = draw(
        st.lists(
            st.one_of(_JSON.filter(lambda v: isinstance(v, dict)), st.just(_deep(MAX_JSON_DEPTH))),
            max_size=2,
        )
    )
    schema = draw(st.one_of(st.none(), st.just({}), st.just(_deep(MAX_JSON_DEPTH + 1))))
    params: dict[str, Any] = {
        "extra": draw(_EXTRA),
        "tools": [{"name": f"f{i}", "parameters": p} for i, p in enumerate(tools)],
        "max_tokens": draw(st.one_of(st.none(), st.integers(min_value=1, max_value=10_000))),
    }
    if schema is not None:
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema},
        }
    return msgspec.convert(
        {
            "id": "r1",
            "tenant": "acme",
            "route": "chat",
            "messages": [{"role": "user", "content": draw(st.text(max_size=300))}],
            "params": params,
        },
        InferenceRequest,
    )


def _error(check: Any, request: InferenceRequest) -> str | None:
    try:
        check(request)
    except MalformedRequestError:
        return "malformed"
    return None


@settings(max_examples=300)
@given(_requests())
def test_params_are_checked_as_before(request: InferenceRequest) -> None:
    assert _error(_routing._check_params, request) == _error(_old_check_params, request)


_COSTS = st.sampled_from([0.0, -0.0, 0.5, 3.0, 1e-9, math.inf])


@settings(max_examples=300)
@given(_requests(), _COSTS, _COSTS)
def test_a_cost_is_estimated_as_before(
    request: InferenceRequest, cost_in: float, cost_out: float
) -> None:
    backend = _Backend(cost_in, cost_out)
    new, old = _routing.estimated_cost(request, backend), _old_estimated_cost(request, backend)
    assert new == old or (math.isnan(new) and math.isnan(old))


def test_a_free_backend_costs_nothing_whatever_the_prompt() -> None:
    request = InferenceRequest(
        id="r1",
        tenant="acme",
        route="chat",
        messages=[ChatMessage(role="user", content="x" * 4000)],
        params=GenerationParams(max_tokens=100),
    )
    assert _routing.estimated_cost(request, _Backend(0.0, 0.0)) == 0.0
