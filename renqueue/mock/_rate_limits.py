"""The rate-limit dialects the mock backend speaks: headers and 429 bodies, as providers send them.

Pure functions from a snapshot of the mock's buckets (:class:`Quota`) and the
wall clock to headers and bodies, one dialect per ``limit_style``
(docs/rate-limits.md has the table). They are written from the providers'
documentation and recorded responses, separately from the parsers in
``renqueue.backends._limits``, so a round trip through both checks one
against the other rather than against itself.

- ``openai``: ``x-ratelimit-*-{requests,tokens}`` (per minute), Go-duration
  resets; 429 ``rate_limit_exceeded`` with ``retry-after`` and ``retry-after-ms``.
- ``groq``: the same names, the requests headers from the per-day bucket;
  ``x-groq-region``; 429 with ``retry-after``.
- ``cerebras``: ``x-ratelimit-*-requests-day`` and ``-tokens-minute``, float
  seconds; 429 ``request_quota_exceeded`` / ``token_quota_exceeded``.
- ``openrouter``: ``X-RateLimit-{Limit,Remaining,Reset}`` (epoch ms) for a
  request bucket, on every response and in the 429 body's
  ``error.metadata.headers``; ``openrouter-body``: only in the 429 body.
- ``anthropic``: ``anthropic-ratelimit-{requests,tokens}-*``, RFC 3339
  resets; 429 ``rate_limit_error`` with ``retry-after``.
- ``gemini``: nothing on success; a 429 ``RESOURCE_EXHAUSTED`` body with
  ``QuotaFailure`` and ``RetryInfo``.
- ``ietf``: ``RateLimit-Policy`` and ``RateLimit`` structured fields; 429
  with ``retry-after``.

Quota exhausted (``quota_exhausted`` setting): OpenAI's
``insufficient_quota``; Groq, Cerebras and IETF daily request counters at 0
until the next UTC midnight; OpenRouter's ``free-models-per-day``; Gemini's
``GenerateRequestsPerDayPerProjectPerModel-FreeTier``. Anthropic has no such
answer: its ordinary 429, every counter at 0.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Final, Literal

import msgspec
from msgspec import Struct

__all__ = ["MOCK_LIMIT_STYLES", "MockLimitStyle", "Quota", "format_reset"]

MockLimitStyle = Literal[
    "openai", "groq", "cerebras", "openrouter", "openrouter-body", "anthropic", "gemini", "ietf"
]
MOCK_LIMIT_STYLES: Final[tuple[MockLimitStyle, ...]] = (
    "openai",
    "groq",
    "cerebras",
    "openrouter",
    "openrouter-body",
    "anthropic",
    "gemini",
    "ietf",
)

_MINUTE: Final = 60.0
_DAY: Final = 86400.0
#: The daily request limit reported when quota is exhausted and no ``rpd`` is declared.
_DEFAULT_DAILY: Final = 1000
_ENCODER: Final = msgspec.json.Encoder()


class Quota(Struct, frozen=True, kw_only=True):
    """One bucket of the mock as of now: ``remaining`` of ``capacity`` per
    ``window`` seconds, full again in ``reset`` seconds."""

    kind: Literal["requests", "tokens"]
    window: float
    capacity: int
    remaining: int
    reset: float


def format_reset(seconds: float) -> str:
    """Seconds in OpenAI's reset format: ``"120ms"``, ``"7.66s"``, ``"6m0s"``, ``"1h2m3s"``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{round(secs, 2):g}s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


def _find(quotas: list[Quota], kind: str, window: float) -> Quota | None:
    return next((q for q in quotas if q.kind == kind and q.window == window), None)


def _rfc3339(when: float) -> str:
    """Whole seconds, rounded up (as Anthropic writes them: ``2024-06-24T17:26:00Z``)."""
    return datetime.fromtimestamp(math.ceil(when), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch_ms(when: float) -> str:
    return str(math.ceil(when * 1000))


def seconds_to_utc_midnight(now: float) -> float:
    """Seconds from ``now`` (Unix time) to the next midnight UTC."""
    return _DAY - now % _DAY


def _openrouter_bucket(quotas: list[Quota], blocked: Quota | None) -> Quota | None:
    """The request bucket OpenRouter's headers describe: the one that refused, else
    the per-minute one, else the per-day one."""
    if blocked is not None and blocked.kind == "requests":
        return blocked
    return _find(quotas, "requests", _MINUTE) or _find(quotas, "requests", _DAY)


def _openrouter_headers(bucket: Quota, now: float) -> dict[str, str]:
    return {
        "X-RateLimit-Limit": str(bucket.capacity),
        "X-RateLimit-Remaining": str(bucket.remaining),
        "X-RateLimit-Reset": _epoch_ms(now + bucket.reset),
    }


_IETF_NAMES: Final = {
    ("requests", _MINUTE): "requests-minute",
    ("tokens", _MINUTE): "tokens-minute",
    ("requests", _DAY): "requests-day",
}


def _openai_headers(style: MockLimitStyle, quotas: list[Quota]) -> dict[str, str]:
    headers: dict[str, str] = {}
    requests_window = _DAY if style == "groq" else _MINUTE
    for kind, window in (("requests", requests_window), ("tokens", _MINUTE)):
        if (quota := _find(quotas, kind, window)) is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(quota.capacity)
            headers[f"x-ratelimit-remaining-{kind}"] = str(quota.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = format_reset(quota.reset)
    if style == "groq":
        headers["x-groq-region"] = "mock"
    return headers


def _cerebras_headers(quotas: list[Quota]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, window, word in (("requests", _DAY, "day"), ("tokens", _MINUTE, "minute")):
        if (quota := _find(quotas, kind, window)) is not None:
            headers[f"x-ratelimit-limit-{kind}-{word}"] = str(quota.capacity)
            headers[f"x-ratelimit-remaining-{kind}-{word}"] = str(quota.remaining)
            headers[f"x-ratelimit-reset-{kind}-{word}"] = repr(float(quota.reset))
    return headers


def _anthropic_headers(quotas: list[Quota], now: float) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        if (quota := _find(quotas, kind, _MINUTE)) is not None:
            prefix = f"anthropic-ratelimit-{kind}-"
            headers[prefix + "limit"] = str(quota.capacity)
            headers[prefix + "remaining"] = str(quota.remaining)
            headers[prefix + "reset"] = _rfc3339(now + quota.reset)
    return headers


def _ietf_headers(quotas: list[Quota]) -> dict[str, str]:
    policies, states = [], []
    for (kind, window), name in _IETF_NAMES.items():
        if (quota := _find(quotas, kind, window)) is not None:
            unit = ';qu="tokens"' if kind == "tokens" else ""
            policies.append(f'"{name}";q={quota.capacity};w={int(window)}{unit}')
            states.append(f'"{name}";r={quota.remaining};t={math.ceil(quota.reset)}')
    if not policies:
        return {}
    return {"RateLimit-Policy": ", ".join(policies), "RateLimit": ", ".join(states)}


def limit_headers(
    style: MockLimitStyle, quotas: list[Quota], now: float, *, blocked: Quota | None = None
) -> dict[str, str]:
    """The rate-limit headers of a response in ``style``, for the buckets as of ``now``
    (gemini and openrouter-body send none)."""
    if style in ("openai", "groq"):
        return _openai_headers(style, quotas)
    if style == "cerebras":
        return _cerebras_headers(quotas)
    if style == "anthropic":
        return _anthropic_headers(quotas, now)
    if style == "ietf":
        return _ietf_headers(quotas)
    if style == "openrouter" and (bucket := _openrouter_bucket(quotas, blocked)) is not None:
        return _openrouter_headers(bucket, now)
    return {}


def _retry_headers(wait: float, *, ms: bool = False) -> dict[str, str]:
    headers = {"retry-after": str(math.ceil(wait))}
    if ms:
        headers["retry-after-ms"] = str(math.ceil(wait * 1000))
    return headers


def _gemini_body(
    model: str, violations: list[tuple[str, str, int]], retry: float | None
) -> dict[str, Any]:
    details: list[dict[str, Any]] = [
        {
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [
                {
                    "quotaMetric": f"generativelanguage.googleapis.com/{metric}",
                    "quotaId": quota_id,
                    "quotaDimensions": {"location": "global", "model": model},
                    "quotaValue": str(value),
                }
                for metric, quota_id, value in violations
            ],
        },
        {
            "@type": "type.googleapis.com/google.rpc.Help",
            "links": [
                {
                    "description": "Learn more about Gemini API quotas",
                    "url": "https://ai.google.dev/gemini-api/docs/rate-limits",
                }
            ],
        },
    ]
    if retry is not None:
        details.append(
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{retry}s"}
        )
    return {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota, please check your plan and billing "
            "details. For more information on this error, head to: "
            "https://ai.google.dev/gemini-api/docs/rate-limits.",
            "status": "RESOURCE_EXHAUSTED",
            "details": details,
        }
    }


_GEMINI_QUOTAS: Final = {
    ("requests", _MINUTE): (
        "generate_content_free_tier_requests",
        "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
    ),
    ("tokens", _MINUTE): (
        "generate_content_free_tier_input_token_count",
        "GenerateContentInputTokensPerModelPerMinute-FreeTier",
    ),
    ("requests", _DAY): (
        "generate_content_free_tier_requests",
        "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
    ),
}


def _window_word(quota: Quota) -> str:
    return "day" if quota.window >= _DAY else "minute"


def rate_limited(
    style: MockLimitStyle,
    quotas: list[Quota],
    blocked: Quota,
    *,
    wait: float,
    need: int,
    model: str,
    now: float,
) -> tuple[dict[str, str], bytes]:
    """Headers and body of the 429 for a request that ``blocked`` has no room for yet."""
    headers = limit_headers(style, quotas, now, blocked=blocked)
    kind, per = blocked.kind, _window_word(blocked)
    body: Any
    if style == "openai":
        headers.update(_retry_headers(wait, ms=True))
        message = (
            f"Rate limit reached for {kind} per {'day' if per == 'day' else 'min'}: "
            f"Limit {blocked.capacity}, "
            f"Remaining {blocked.remaining}, Requested {need}. "
            f"Please try again in {format_reset(wait)}."
        )
        body = {"error": {"message": message, "type": kind, "code": "rate_limit_exceeded"}}
    elif style == "groq":
        headers.update(_retry_headers(wait))
        unit = ("RPD" if per == "day" else "RPM") if kind == "requests" else "TPM"
        message = (
            f"Rate limit reached for model `{model}` in organization `org_mock` service tier "
            f"`on_demand` on {kind} per {per} ({unit}): Limit {blocked.capacity}, "
            f"Used {blocked.capacity - blocked.remaining}, Requested {need}. "
            f"Please try again in {format_reset(wait)}."
        )
        body = {"error": {"message": message, "type": kind, "code": "rate_limit_exceeded"}}
    elif style == "cerebras":
        what = "Requests" if kind == "requests" else "Tokens"
        done = "sent" if kind == "requests" else "processed"
        body = {
            "message": f"{what} per {per} limit exceeded - too many {kind} {done}.",
            "type": "too_many_requests_error",
            "param": "quota",
            "code": "request_quota_exceeded" if kind == "requests" else "token_quota_exceeded",
        }
    elif style in ("openrouter", "openrouter-body"):
        bucket = _openrouter_bucket(quotas, blocked)
        metadata = {"headers": _openrouter_headers(bucket, now) if bucket else {}}
        free = "free-models-per-day" if per == "day" else "free-models-per-min"
        body = {
            "error": {
                "message": f"Rate limit exceeded: {free}. ",
                "code": 429,
                "metadata": {**metadata, "provider_name": None},
            },
            "user_id": "user_mock",
        }
    elif style == "anthropic":
        headers.update(_retry_headers(wait))
        message = (
            f"This request would exceed the rate limit for your organization of "
            f"{blocked.capacity} {kind} per minute. Please try again later."
        )
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    elif style == "gemini":
        metric, quota_id = _GEMINI_QUOTAS[(kind, blocked.window)]
        body = _gemini_body(model, [(metric, quota_id, blocked.capacity)], math.ceil(wait))
    else:  # ietf
        headers.update(_retry_headers(wait))
        body = {"error": {"message": f"{kind} per {per} limit reached", "code": 429}}
    return headers, _ENCODER.encode(body)


def quota_exhausted(
    style: MockLimitStyle, quotas: list[Quota], *, daily: int, model: str, now: float
) -> tuple[dict[str, str], bytes]:
    """Headers and body of a 429 that says the quota is gone for the day (or for good).

    ``daily``: the per-day request limit to report (the declared ``rpd``, or
    1000 when none is). Daily counters are at 0 until the next UTC midnight.
    """
    daily = daily or _DEFAULT_DAILY
    until = seconds_to_utc_midnight(now)
    empty_day = Quota(kind="requests", window=_DAY, capacity=daily, remaining=0, reset=until)
    others = [q for q in quotas if not (q.kind == "requests" and q.window == _DAY)]
    if style == "openai":
        message = (
            "You exceeded your current quota, please check your plan and billing details. "
            "For more information on this error, read the docs: "
            "https://platform.openai.com/docs/guides/error-codes/api-errors."
        )
        body: Any = {
            "error": {
                "message": message,
                "type": "insufficient_quota",
                "param": None,
                "code": "insufficient_quota",
            }
        }
        return {}, _ENCODER.encode(body)
    if style == "anthropic":
        # No daily quota at Anthropic: its ordinary 429, every counter spent.
        spent = [
            Quota(kind=q.kind, window=q.window, capacity=q.capacity, remaining=0, reset=q.reset)
            for q in quotas
        ]
        blocked = spent[0] if spent else empty_day
        return rate_limited(style, spent, blocked, wait=blocked.reset, need=1, model=model, now=now)
    if style == "gemini":
        metric, quota_id = _GEMINI_QUOTAS[("requests", _DAY)]
        return {}, _ENCODER.encode(_gemini_body(model, [(metric, quota_id, daily)], None))
    return rate_limited(
        style, [*others, empty_day], empty_day, wait=until, need=1, model=model, now=now
    )
