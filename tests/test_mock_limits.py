"""Round trips: the mock speaks each provider's rate-limit dialect, the parsers read it back.

The mock writes its formats (renqueue/mock/_rate_limits.py) from the providers'
docs independently of the parsers (renqueue/backends/_limits.py), so each
round trip checks one against the other: the limit, remaining and reset the
mock's buckets hold are what the parser reports.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from renqueue.backends import LearnedLimits, LimitWindow, parse_limits
from renqueue.backends._limits import DAY, MINUTE
from renqueue.backends.openai import OpenAIBackend
from renqueue.config import BackendConfig
from renqueue.errors import RateLimitedError
from renqueue.mock import MockBackend, MockSettings
from renqueue.mock._rate_limits import MOCK_LIMIT_STYLES
from renqueue.schema import ChatMessage, InferenceRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "12345678"}]}  # 2 prompt tokens

#: The parser style for each mock style.
PARSER_STYLE = {style: style for style in (*MOCK_LIMIT_STYLES, "auto")} | {
    "openrouter-body": "openrouter"
}

#: One request of 2 prompt + 4 output tokens against rpm=10, tpm=1000, rpd=100:
#: (kind, window) -> (limit, remaining, seconds until the bucket is full again).
AFTER_ONE = {
    ("requests", MINUTE): (10, 9, 6.0),
    ("tokens", MINUTE): (1000, 994, 0.36),
    ("requests", DAY): (100, 99, 864.0),
}

#: What each dialect reports of those buckets on a successful response.
REPORTED: dict[str, list[tuple[str, float | None]]] = {
    "openai": [("requests", MINUTE), ("tokens", MINUTE)],
    "groq": [("requests", DAY), ("tokens", MINUTE)],  # Groq's request headers are per day
    "cerebras": [("requests", DAY), ("tokens", MINUTE)],
    "openrouter": [("requests", None)],  # the per-minute bucket; no window on a success
    "openrouter-body": [],  # only inside a 429's body
    "anthropic": [("requests", MINUTE), ("tokens", MINUTE)],
    "gemini": [],  # only in a 429's body
    "ietf": [("requests", MINUTE), ("tokens", MINUTE), ("requests", DAY)],
}

#: Resets rounded up by the format: Anthropic's whole-second RFC 3339, IETF's integer t.
ROUNDING = {"anthropic": 1.0, "ietf": 1.0}


@pytest.fixture
async def mock() -> AsyncIterator[MockBackend]:
    async with MockBackend(MockSettings(output_tokens=4)) as server:
        yield server


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5) as http:
        yield http


async def call(client: httpx.AsyncClient, mock: MockBackend) -> tuple[httpx.Response, float]:
    response = await client.post(f"{mock.url}/chat/completions", json=CHAT)
    return response, time.time()


def read(response: httpx.Response, now: float, style: str) -> LearnedLimits:
    return parse_limits(
        response.headers,
        now=now,
        status=response.status_code,
        body=response.content,
        style=PARSER_STYLE[style],  # type: ignore[arg-type]
    )


def exact(limits: LearnedLimits, kind: str, window: float | None) -> LimitWindow:
    found = [w for w in limits.windows if w.kind == kind and w.window == window]
    assert len(found) == 1, f"no single {kind}/{window} in {limits.windows}"
    return found[0]


def utc_midnight_after(now: float) -> float:
    day = datetime.fromtimestamp(now, UTC).date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()


def pacific_midnight_after(now: float) -> float:
    pacific = ZoneInfo("America/Los_Angeles")
    day = datetime.fromtimestamp(now, pacific).date() + timedelta(days=1)
    return datetime(day.year, day.month, day.day, tzinfo=pacific).timestamp()


@pytest.mark.parametrize("parse_as", ["named", "auto"])
@pytest.mark.parametrize("style", MOCK_LIMIT_STYLES)
async def test_success_headers_read_back_as_the_buckets_hold_them(
    mock: MockBackend, client: httpx.AsyncClient, style: str, parse_as: str
) -> None:
    mock.update(rpm=10, tpm=1000, rpd=100, limit_style=style)
    response, now = await call(client, mock)
    assert response.status_code == 200
    limits = read(response, now, style if parse_as == "named" else "auto")
    reported = REPORTED[style]
    assert len(limits.windows) == len(reported)
    for kind, window in reported:
        entry = exact(limits, kind, window)
        limit, remaining, reset = AFTER_ONE[(kind, window or MINUTE)]
        assert (entry.limit, entry.remaining) == (limit, remaining)
        assert entry.reset_at is not None
        assert reset - 0.5 <= entry.reset_at - now <= reset + 0.5 + ROUNDING.get(style, 0)
    assert not limits.quota_exhausted
    assert limits.retry_at is None


#: Per dialect, the window a 429 from ``rpm=1`` reports (None: not reported), and
#: whether the mock sends a retry time.
BLOCKED_MINUTE: dict[str, tuple[float | None, bool]] = {
    "openai": (MINUTE, True),
    "groq": (None, True),  # Groq reports requests per day, not the RPM that refused
    "cerebras": (None, False),  # likewise; and no retry-after is documented
    "openrouter": (MINUTE, False),  # the reset is in the headers
    "openrouter-body": (MINUTE, False),
    "anthropic": (MINUTE, True),
    "gemini": (MINUTE, True),  # RetryInfo
    "ietf": (MINUTE, True),
}


@pytest.mark.parametrize("style", MOCK_LIMIT_STYLES)
async def test_a_429_reads_back_the_refusing_bucket_and_when_to_retry(
    mock: MockBackend, client: httpx.AsyncClient, style: str
) -> None:
    mock.update(rpm=1, rpd=100, limit_style=style)
    first, _ = await call(client, mock)
    assert first.status_code == 200
    refused, now = await call(client, mock)
    assert refused.status_code == 429
    limits = read(refused, now, style)
    window, retries = BLOCKED_MINUTE[style]
    if window is not None:
        entry = exact(limits, "requests", window)
        assert entry.limit == 1
        assert entry.remaining == 0
        assert entry.reset_at is not None
        assert 58 <= entry.reset_at - now <= 61.5
    assert (limits.retry_at is not None) == retries
    if window is not None or retries:
        assert 58 <= (limits.retry_after() or 0) <= 61.5
    else:
        # Not told which limit refused nor when to retry: not the daily reset either.
        assert limits.retry_after() is None
    assert not limits.quota_exhausted
    assert mock.stats().rate_limited == 1


@pytest.mark.parametrize("style", ["groq", "cerebras", "openrouter", "openrouter-body", "ietf"])
async def test_a_spent_daily_bucket_is_quota_exhausted_until_its_reset(
    mock: MockBackend, client: httpx.AsyncClient, style: str
) -> None:
    mock.update(rpd=1, limit_style=style)
    await call(client, mock)
    refused, now = await call(client, mock)
    assert refused.status_code == 429
    limits = read(refused, now, style)
    entry = exact(limits, "requests", DAY)
    assert (entry.limit, entry.remaining) == (1, 0)
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until is not None
    # A bucket of one request per day is full again a day after that request.
    assert DAY - 5 <= limits.quota_exhausted_until - now <= DAY + 1


#: Per dialect: how a quota-exhausted 429 reads (exhausted, and until when).
EXHAUSTED = {
    "openai": "unknown",  # insufficient_quota: billing, no reset
    "groq": "utc",
    "cerebras": "utc",
    "openrouter": "utc",
    "openrouter-body": "utc",
    "gemini": "pacific",  # Gemini's daily quotas reset at midnight US Pacific
    "ietf": "utc",
    "anthropic": "not",  # Anthropic has no daily quota answer: an ordinary 429
}


@pytest.mark.parametrize("style", MOCK_LIMIT_STYLES)
async def test_quota_exhausted_setting_reads_back_as_exhausted(
    mock: MockBackend, client: httpx.AsyncClient, style: str
) -> None:
    mock.update(rpm=10, tpm=1000, limit_style=style, quota_exhausted=True)
    refused, now = await call(client, mock)
    assert refused.status_code == 429
    stats = mock.stats()
    assert (stats.rate_limited, stats.completed) == (1, 0)
    limits = read(refused, now, style)
    auto = read(refused, now, "auto")
    expected = EXHAUSTED[style]
    assert limits.quota_exhausted == auto.quota_exhausted == (expected != "not")
    until = limits.quota_exhausted_until
    if expected == "unknown":
        assert until is None
    elif expected == "utc":
        assert until == pytest.approx(utc_midnight_after(now), abs=2)
    elif expected == "pacific":
        assert until == pytest.approx(pacific_midnight_after(now), abs=1)


async def test_quota_exhausted_reports_the_declared_daily_limit(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    mock.update(rpd=14400, limit_style="groq", quota_exhausted=True)
    refused, now = await call(client, mock)
    entry = exact(read(refused, now, "groq"), "requests", DAY)
    assert (entry.limit, entry.remaining) == (14400, 0)


async def test_switching_style_and_quota_at_runtime_over_http(
    mock: MockBackend, client: httpx.AsyncClient
) -> None:
    changed = await client.post(
        f"http://127.0.0.1:{mock.port}/admin/settings",
        json={"limit_style": "anthropic", "rpm": 5},
    )
    assert changed.json()["limit_style"] == "anthropic"
    response, now = await call(client, mock)
    assert exact(read(response, now, "anthropic"), "requests", MINUTE).remaining == 4
    bad = await client.post(
        f"http://127.0.0.1:{mock.port}/admin/settings", json={"limit_style": "smoke-signals"}
    )
    assert bad.status_code == 400


# ------------------------------------------------------------- the adapter


def request() -> InferenceRequest:
    return InferenceRequest(
        id="req-1", route="chat", messages=[ChatMessage(role="user", content="12345678")]
    )


async def test_the_adapter_reads_the_dialect_its_config_names(mock: MockBackend) -> None:
    mock.update(rpm=10, tpm=1000, rpd=100, limit_style="groq")
    config = BackendConfig(base_url=mock.url, model="m", limit_style="groq")
    async with OpenAIBackend("groq", config) as adapter:
        await adapter.complete(request())
        limits = adapter.last_rate_limit
    assert limits is not None
    assert exact(limits, "requests", DAY).remaining == 99
    assert exact(limits, "tokens", MINUTE).remaining == 994


@pytest.mark.parametrize(
    ("style", "until"), [("openai", None), ("gemini", "pacific"), ("openrouter-body", "utc")]
)
async def test_a_quota_exhausted_429_says_so_on_the_error(
    mock: MockBackend, style: str, until: str | None
) -> None:
    mock.update(limit_style=style, quota_exhausted=True)
    config = BackendConfig(base_url=mock.url, model="m")  # limit_style auto
    async with OpenAIBackend("free", config) as adapter:
        with pytest.raises(RateLimitedError) as caught:
            await adapter.complete(request())
        limits = adapter.last_rate_limit
    now = time.time()
    error: Any = caught.value
    assert error.quota_exhausted
    assert limits is not None
    assert limits.quota_exhausted
    if until is None:
        assert error.quota_exhausted_until is None
    else:
        midnight = pacific_midnight_after(now) if until == "pacific" else utc_midnight_after(now)
        assert error.quota_exhausted_until == pytest.approx(midnight, abs=2)


async def test_an_ordinary_429_is_not_quota_exhausted(mock: MockBackend) -> None:
    mock.update(rpm=1, limit_style="gemini")
    async with OpenAIBackend("g", BackendConfig(base_url=mock.url, model="m")) as adapter:
        await adapter.complete(request())
        with pytest.raises(RateLimitedError) as caught:
            await adapter.complete(request())
    assert not caught.value.quota_exhausted
    assert caught.value.retry_after is not None
    assert 58 <= caught.value.retry_after <= 61
