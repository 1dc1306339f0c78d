"""Every failure leaves the OpenAI adapter classified (issue #9 item 1).

Against the mock backend's injected faults, on loopback: the adapter raises a
``BackendError`` whose ``failure`` (a ``FailureClass``) is what the failure
policy acts on, whatever the exception type. Text streamed before a failure
makes it a broken stream. No hidden retries: each call is one request.
"""

from __future__ import annotations

import pytest

from renqueue.backends.base import Delta
from renqueue.backends.openai import OpenAIBackend
from renqueue.config import BackendConfig
from renqueue.errors import BackendError, FailureClass
from renqueue.mock import FaultSpec, MockBackend, MockSettings
from renqueue.schema import ChatMessage, InferenceRequest

REQUEST = InferenceRequest(
    id="req-1", route="chat", messages=[ChatMessage(role="user", content="hello there")]
)


async def call(
    settings: MockSettings, **config: object
) -> tuple[list[Delta], BackendError | None, MockBackend]:
    """One streamed call: what it yielded, and the error it ended with."""
    async with MockBackend(settings) as mock:
        backend = OpenAIBackend(
            "b",
            BackendConfig(base_url=mock.url, model="m", **config),  # type: ignore[arg-type]
        )
        deltas: list[Delta] = []
        try:
            async for delta in backend.stream(REQUEST):
                deltas.append(delta)
        except BackendError as exc:
            return deltas, exc, mock
        finally:
            await backend.close()
    return deltas, None, mock


def fault(kind: str, **spec: object) -> MockSettings:
    return MockSettings(
        ttft=0.0,
        output_tokens=6,
        faults=FaultSpec(script=(kind,), **spec),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("500", FailureClass.SERVER_ERROR),
        ("503", FailureClass.OVERLOADED),
        ("529", FailureClass.OVERLOADED),
        ("reset", FailureClass.CONNECT),
        ("429", FailureClass.RATE_LIMITED),
        ("429_bare", FailureClass.RATE_LIMITED),
        ("quota", FailureClass.QUOTA_EXHAUSTED),
        ("context_length", FailureClass.CONTEXT_LENGTH),
        ("content_filter", FailureClass.CONTENT_FILTER),
        ("malformed", FailureClass.MALFORMED),
    ],
)
async def test_each_fault_is_classified(kind: str, expected: FailureClass) -> None:
    # after_tokens=0: the fault strikes before any token (a cut or error after
    # tokens is a broken stream: below).
    deltas, error, mock = await call(fault(kind, after_tokens=0))
    assert error is not None, deltas
    assert error.failure is expected, error
    assert mock.stats().requests == 1, "the adapter retried by itself"


@pytest.mark.parametrize("kind", ["break", "sse_error", "malformed"])
async def test_a_failure_after_tokens_were_yielded_is_a_broken_stream(kind: str) -> None:
    settings = MockSettings(
        ttft=0.0,
        output_tokens=8,
        tokens_per_second=100,
        faults=FaultSpec(script=(kind,), after_tokens=3),
    )
    deltas, error, _ = await call(settings)
    assert any(d.text for d in deltas), "tokens came first"
    assert error is not None
    assert error.failure is FailureClass.BROKEN_STREAM
    assert "stream broke after tokens were sent" in str(error)


async def test_a_stream_with_a_finish_reason_but_no_done_is_complete() -> None:
    deltas, error, _ = await call(fault("no_done"))
    assert error is None
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas)


@pytest.mark.parametrize(
    ("after_tokens", "expected"),
    [(3, FailureClass.BROKEN_STREAM), (0, FailureClass.MALFORMED)],
)
async def test_a_bare_done_without_a_finish_reason_is_a_broken_stream(
    after_tokens: int, expected: FailureClass
) -> None:
    """llama-cpp-python's server cuts a running stream short with a bare ``[DONE]``
    (``no_finish``): a truncated answer, never a complete one."""
    settings = MockSettings(
        ttft=0.0,
        output_tokens=8,
        tokens_per_second=100,
        faults=FaultSpec(script=("no_finish",), after_tokens=after_tokens),
    )
    deltas, error, _ = await call(settings)
    assert error is not None, deltas
    assert error.failure is expected
    assert error.retryable
    assert "stream ended with [DONE] but no finish_reason" in str(error)
    assert "".join(d.text for d in deltas) == " ".join(f"tok{i}" for i in range(after_tokens))


async def test_a_down_backend_is_a_connection_failure() -> None:
    _, error, _ = await call(MockSettings(down=True))
    assert error is not None
    assert error.failure is FailureClass.CONNECT


async def test_a_refused_connection_is_a_connection_failure() -> None:
    async with MockBackend(MockSettings()) as mock:
        url = mock.url
    backend = OpenAIBackend("b", BackendConfig(base_url=url, model="m"))
    with pytest.raises(BackendError) as info:
        async for _ in backend.stream(REQUEST):
            pass
    await backend.close()
    assert info.value.failure is FailureClass.CONNECT


async def test_no_first_token_in_time_is_a_first_token_timeout() -> None:
    deltas, error, _ = await call(fault("hang"), first_token_timeout="200ms")
    assert error is not None
    assert error.failure is FailureClass.FIRST_TOKEN_TIMEOUT
    assert not deltas


async def test_a_silence_between_tokens_is_a_stall() -> None:
    deltas, error, _ = await call(fault("drip", drip_gap=2.0), timeout="300ms")
    assert error is not None
    # The first token came: a silence after it is a stall (a broken stream,
    # since text had been yielded) ...
    if deltas:
        assert error.failure is FailureClass.BROKEN_STREAM
        assert "stall" in str(error)
    else:  # ... or, if the silence came before it, a first-token timeout.
        assert error.failure is FailureClass.FIRST_TOKEN_TIMEOUT


async def test_a_call_longer_than_total_timeout_is_a_total_timeout() -> None:
    slow = MockSettings(ttft=0.0, output_tokens=50, tokens_per_second=20)
    deltas, error, _ = await call(slow, total_timeout="300ms")
    assert error is not None
    assert deltas, "tokens had come"
    assert error.failure is FailureClass.TOTAL_TIMEOUT  # its length, not a broken backend
    assert "total_timeout" in str(error)
    # Nothing at all before it: the backend's silence, a fault (a hung backend
    # must open its circuit even when only total_timeout is set).
    slow_start = MockSettings(ttft=2.0, output_tokens=5)
    deltas, error, _ = await call(slow_start, total_timeout="300ms")
    assert error is not None
    assert error.failure is FailureClass.FIRST_TOKEN_TIMEOUT
    assert not deltas


async def test_an_unknown_model_is_unavailable() -> None:
    _, error, _ = await call(MockSettings(models=("other",)))
    assert error is not None
    assert error.failure is FailureClass.UNAVAILABLE
