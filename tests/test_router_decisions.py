"""The routing decision and request validation are plain functions: test them directly."""

from __future__ import annotations

import pytest

from renqueue.config import parse_config
from renqueue.errors import MalformedRequestError, UnknownRouteError
from renqueue.policy import BackendView, NoRoom, choose_backend, validate
from renqueue.wire import ChatMessage, InferenceRequest

CONFIG = parse_config(
    {
        "backends": {
            name: {"base_url": "http://127.0.0.1:1/v1", "model": "m"} for name in ("a", "b")
        },
        "routes": {"chat": {"backends": ["a", "b"]}},
    }
)


def request(**fields: object) -> InferenceRequest:
    base: dict[str, object] = {
        "id": "r1",
        "tenant": "t",
        "route": "chat",
        "priority": "normal",
        "messages": [ChatMessage(role="user", content="hi")],
    }
    return InferenceRequest(**{**base, **fields})  # type: ignore[arg-type]


def views(**in_flight: int) -> dict[str, BackendView]:
    return {
        "a": BackendView(name="a", capacity=2, in_flight=in_flight.get("a", 0), tier=1),
        "b": BackendView(name="b", capacity=1, in_flight=in_flight.get("b", 0), tier=3),
    }


def test_first_candidate_with_a_free_slot_wins() -> None:
    assert choose_backend(request(), ["a", "b"], views()) == "a"
    assert choose_backend(request(), ["a", "b"], views(a=2)) == "b"


def test_all_full_means_wait() -> None:
    assert choose_backend(request(), ["a", "b"], views(a=2, b=1)) is NoRoom.FULL


def test_unhealthy_and_too_weak_backends_are_skipped() -> None:
    sick = {**views(), "a": BackendView(name="a", capacity=2, in_flight=0, healthy=False)}
    assert choose_backend(request(), ["a", "b"], sick) == "b"
    assert choose_backend(request(complexity=2), ["a", "b"], views()) == "b"
    assert choose_backend(request(complexity=5), ["a", "b"], views()) is NoRoom.NONE_CAPABLE


def test_validate_rejects_mismatched_tenant_level_and_unknown_route() -> None:
    validate(request(), level="normal", tenant="t", config=CONFIG)
    with pytest.raises(MalformedRequestError, match="tenant"):
        validate(request(), level="normal", tenant="other", config=CONFIG)
    with pytest.raises(MalformedRequestError, match="priority"):
        validate(request(), level="high", tenant="t", config=CONFIG)
    with pytest.raises(UnknownRouteError):
        validate(request(route="nope"), level="normal", tenant="t", config=CONFIG)
