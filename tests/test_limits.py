"""The rate-limit parsers (renqueue.backends._limits), one dialect at a time.

The examples are what the providers send, as their docs and bug reports show
them (values as recorded; only timestamps are moved next to ``NOW``).
"""

from __future__ import annotations

import math
import os
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from renqueue.backends import LearnedLimits, LimitWindow, parse_limits
from renqueue.backends._limits import DAY, HOUR, MINUTE, names_limits

#: 2025-06-15T15:06:40Z (08:06:40 in US Pacific, summer time).
NOW = 1_750_000_000.0


def window(limits: LearnedLimits, kind: str, length: float | None) -> LimitWindow:
    """The window of ``kind`` and exactly ``length`` (``None``: the format did not say)."""
    found = [w for w in limits.windows if w.kind == kind and w.window == length]
    assert len(found) == 1, f"no single {kind}/{length} in {limits.windows}"
    return found[0]


def reset_in(entry: LimitWindow) -> float:
    assert entry.reset_at is not None
    return round(entry.reset_at - NOW, 6)


# ------------------------------------------------------------------ OpenAI

OPENAI_DOCS = {
    "x-ratelimit-limit-requests": "60",
    "x-ratelimit-limit-tokens": "150000",
    "x-ratelimit-remaining-requests": "59",
    "x-ratelimit-remaining-tokens": "149984",
    "x-ratelimit-reset-requests": "1s",
    "x-ratelimit-reset-tokens": "6m0s",
}

#: A chat-completions response as a user posted it (community.openai.com).
OPENAI_RECORDED = {
    "date": "Mon, 26 May 2025 05:00:04 GMT",
    "content-type": "application/json",
    "x-ratelimit-limit-requests": "5000",
    "x-ratelimit-limit-tokens": "160000",
    "x-ratelimit-limit-tokens_usage_based": "160000",
    "x-ratelimit-remaining-requests": "4999",
    "x-ratelimit-remaining-tokens": "159976",
    "x-ratelimit-remaining-tokens_usage_based": "159976",
    "x-ratelimit-reset-requests": "12ms",
    "x-ratelimit-reset-tokens": "9ms",
    "x-ratelimit-reset-tokens_usage_based": "9ms",
}


def test_openai_headers_are_per_minute_requests_and_tokens() -> None:
    limits = parse_limits(OPENAI_DOCS, now=NOW, status=200)
    requests = window(limits, "requests", MINUTE)
    tokens = window(limits, "tokens", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (60, 59, 1.0)
    assert (tokens.limit, tokens.remaining, reset_in(tokens)) == (150000, 149984, 360.0)
    assert limits.sources == ("openai",)
    assert limits.at == NOW
    assert not limits.quota_exhausted
    assert limits.retry_at is None


def test_openai_recorded_response_with_millisecond_resets() -> None:
    limits = parse_limits(OPENAI_RECORDED, now=NOW, style="openai")
    assert len(limits.windows) == 2  # the _usage_based variants are not separate quotas
    assert reset_in(window(limits, "requests", MINUTE)) == 0.012
    assert reset_in(window(limits, "tokens", MINUTE)) == 0.009


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("1.5s", 1.5),
        ("12ms", 0.012),
        ("1h2m3.5s", 3723.5),
        ("2m59.56s", 179.56),
        ("7.66s", 7.66),
        ("0s", 0.0),
        ("0", 0.0),
        ("500\u00b5s", 0.0005),
        ("250us", 0.00025),
        ("7.5", 7.5),  # a bare number is seconds
        ("soon", None),
        ("", None),
        ("-1s", None),
        ("1s2", None),
        ("1e3s", None),
        ("nan", None),
        ("inf", None),
        ("99999999h", None),  # further than anything real: garbage
    ],
)
def test_go_duration_resets(text: str, seconds: float | None) -> None:
    limits = parse_limits({"x-ratelimit-reset-requests": text}, now=NOW, style="openai")
    if seconds is None:
        assert limits.windows == ()
    else:
        assert reset_in(window(limits, "requests", MINUTE)) == pytest.approx(seconds)


def test_a_huge_bare_reset_is_a_unix_time() -> None:
    headers = {"x-ratelimit-reset-requests": str(int(NOW + 90))}
    assert reset_in(window(parse_limits(headers, now=NOW), "requests", MINUTE)) == 90
    headers = {"x-ratelimit-reset-requests": str(int((NOW + 90) * 1000))}
    assert reset_in(window(parse_limits(headers, now=NOW), "requests", MINUTE)) == 90


def test_header_names_are_case_insensitive() -> None:
    shouted = {name.upper(): value for name, value in OPENAI_DOCS.items()}
    titled = {name.title(): value for name, value in OPENAI_DOCS.items()}
    expected = parse_limits(OPENAI_DOCS, now=NOW)
    assert parse_limits(shouted, now=NOW) == expected
    assert parse_limits(titled, now=NOW) == expected


def test_unreadable_fields_are_none_and_the_rest_stands() -> None:
    headers = {
        "x-ratelimit-limit-requests": "lots",
        "x-ratelimit-remaining-requests": "-3",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "1e400",
        "x-ratelimit-reset-tokens": "whenever",
    }
    limits = parse_limits(headers, now=NOW)
    requests = window(limits, "requests", MINUTE)
    tokens = window(limits, "tokens", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (None, None, 2.0)
    assert (tokens.limit, tokens.remaining, tokens.reset_at) == (6000, None, None)


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), 2**63, -1, 1.5e300, True, "1" * 400],
    ids=["huge", "-huge", "2**63", "-1", "1.5e300", "True", "400 digits"],
)
def test_a_count_out_of_range_in_a_body_is_none(value: object) -> None:
    body = {
        "error": {
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                            "quotaValue": value,
                        }
                    ],
                }
            ]
        }
    }
    limits = parse_limits({}, now=NOW, status=429, body=body)
    assert window(limits, "requests", MINUTE).limit is None


def test_no_limit_headers_is_an_empty_reading() -> None:
    limits = parse_limits({"content-type": "application/json"}, now=NOW)
    assert limits.empty
    assert limits.windows == ()
    assert limits.retry_after() is None


# -------------------------------------------------------------------- Groq

#: Groq's documented example (console.groq.com/docs/rate-limits), on a 429.
GROQ_429 = {
    "retry-after": "2",
    "x-ratelimit-limit-requests": "14400",
    "x-ratelimit-limit-tokens": "18000",
    "x-ratelimit-remaining-requests": "14370",
    "x-ratelimit-remaining-tokens": "17997",
    "x-ratelimit-reset-requests": "2m59.56s",
    "x-ratelimit-reset-tokens": "7.66s",
}


def test_groq_request_headers_count_per_day_and_tokens_per_minute() -> None:
    limits = parse_limits(GROQ_429, now=NOW, status=429, style="groq")
    requests = window(limits, "requests", DAY)
    tokens = window(limits, "tokens", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (14400, 14370, 179.56)
    assert (tokens.limit, tokens.remaining, reset_in(tokens)) == (18000, 17997, 7.66)
    assert limits.retry_at == NOW + 2
    assert limits.retry_after() == 2.0
    assert limits.sources == ("retry-after", "groq")


def test_auto_tells_groq_from_openai_by_its_region_header() -> None:
    assert parse_limits(GROQ_429, now=NOW).find("requests", MINUTE) is not None
    tagged = {**GROQ_429, "x-groq-region": "dls"}
    assert parse_limits(tagged, now=NOW).find("requests", DAY) is not None
    assert parse_limits(tagged, now=NOW).find("requests", MINUTE) is None


def test_groq_daily_requests_at_zero_is_quota_exhausted_until_the_reset() -> None:
    headers = {**GROQ_429, "x-ratelimit-remaining-requests": "0"}
    limits = parse_limits(headers, now=NOW, status=429, style="groq")
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until == pytest.approx(NOW + 179.56)
    # The same counter read as OpenAI's per-minute one is an ordinary wait.
    assert not parse_limits(headers, now=NOW, status=429, style="openai").quota_exhausted


# ---------------------------------------------------------------- Cerebras

#: Cerebras' documented example (inference-docs.cerebras.ai/support/rate-limits).
CEREBRAS = {
    "x-ratelimit-limit-requests-day": "1000000000",
    "x-ratelimit-limit-tokens-minute": "1000000000",
    "x-ratelimit-remaining-requests-day": "999997455",
    "x-ratelimit-remaining-tokens-minute": "999998298",
    "x-ratelimit-reset-requests-day": "33011.382867097855",
    "x-ratelimit-reset-tokens-minute": "11.382867097854614",
}


@pytest.mark.parametrize("style", ["cerebras", "auto"])
def test_cerebras_suffixed_headers_with_float_second_resets(style: str) -> None:
    limits = parse_limits(CEREBRAS, now=NOW, style=style)  # type: ignore[arg-type]
    requests = window(limits, "requests", DAY)
    tokens = window(limits, "tokens", MINUTE)
    assert (requests.limit, requests.remaining) == (1_000_000_000, 999_997_455)
    assert reset_in(requests) == pytest.approx(33011.382867, abs=1e-5)
    assert (tokens.limit, tokens.remaining) == (1_000_000_000, 999_998_298)
    assert reset_in(tokens) == pytest.approx(11.382867, abs=1e-5)
    assert limits.sources == ("cerebras",)
    assert not limits.quota_exhausted


def test_cerebras_daily_requests_at_zero_is_quota_exhausted() -> None:
    headers = {**CEREBRAS, "x-ratelimit-remaining-requests-day": "0"}
    limits = parse_limits(headers, now=NOW, status=429)
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until == pytest.approx(NOW + 33011.382867)
    # Per-minute tokens at zero: wait, do not take the backend out.
    headers = {**CEREBRAS, "x-ratelimit-remaining-tokens-minute": "0"}
    limits = parse_limits(headers, now=NOW, status=429)
    assert not limits.quota_exhausted
    assert limits.retry_after() == pytest.approx(11.383, abs=1e-3)


def test_other_suffixed_windows_are_read_too() -> None:
    headers = {
        "x-ratelimit-limit-requests-minute": "30",
        "x-ratelimit-remaining-requests-minute": "29",
        "x-ratelimit-limit-tokens-hour": "1000000",
        "x-ratelimit-reset-tokens-hour": "1800",
    }
    limits = parse_limits(headers, now=NOW, style="cerebras")
    assert window(limits, "requests", MINUTE).remaining == 29
    assert reset_in(window(limits, "tokens", HOUR)) == 1800


# -------------------------------------------------------------- OpenRouter

#: A free-tier 429 as a user recorded it: the limits only in the body.
OPENROUTER_DAY_BODY = {
    "error": {
        "message": "Rate limit exceeded: free-models-per-day. "
        "Add 10 credits to unlock 1000 free model requests per day",
        "code": 429,
        "metadata": {
            "headers": {
                "X-RateLimit-Limit": "50",
                "X-RateLimit-Remaining": "0",
                "X-RateLimit-Reset": str(int((NOW + 32_000) * 1000)),
            },
            "provider_name": None,
        },
    },
    "user_id": "user_2abc",
}


def test_openrouter_limits_inside_the_error_body() -> None:
    limits = parse_limits({}, now=NOW, status=429, body=OPENROUTER_DAY_BODY, style="openrouter")
    requests = window(limits, "requests", DAY)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (50, 0, 32_000)
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until == NOW + 32_000
    assert limits.sources == ("openrouter-body",)


def test_openrouter_body_as_raw_bytes_in_auto_mode() -> None:
    import msgspec  # noqa: PLC0415

    raw = msgspec.json.encode(OPENROUTER_DAY_BODY)
    limits = parse_limits({"content-type": "application/json"}, now=NOW, status=429, body=raw)
    assert window(limits, "requests", DAY).limit == 50
    assert limits.quota_exhausted


def test_openrouter_headers_on_the_response_per_minute() -> None:
    headers = {
        "X-RateLimit-Limit": "20",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": str(int((NOW + 41.5) * 1000)),
    }
    body = {"error": {"message": "Rate limit exceeded: free-models-per-min. ", "code": 429}}
    limits = parse_limits(headers, now=NOW, status=429, body=body)
    requests = window(limits, "requests", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (20, 0, 41.5)
    assert not limits.quota_exhausted
    assert limits.retry_after() == 41.5
    assert limits.sources == ("openrouter",)


def test_a_generic_x_ratelimit_trio_has_no_known_window() -> None:
    headers = {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "12", "X-RateLimit-Reset": "30"}
    requests = window(parse_limits(headers, now=NOW), "requests", None)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (60, 12, 30)


def test_a_reset_already_past_is_now() -> None:
    headers = {"X-RateLimit-Remaining": "3", "X-RateLimit-Reset": str(int((NOW - 5) * 1000))}
    assert window(parse_limits(headers, now=NOW), "requests", None).reset_at == NOW


# --------------------------------------------------------------- Anthropic

ANTHROPIC = {
    "retry-after": "12",
    "anthropic-ratelimit-requests-limit": "50",
    "anthropic-ratelimit-requests-remaining": "0",
    "anthropic-ratelimit-requests-reset": "2025-06-15T15:06:52Z",
    "anthropic-ratelimit-tokens-limit": "50000",
    "anthropic-ratelimit-tokens-remaining": "48000",
    "anthropic-ratelimit-tokens-reset": "2025-06-15T15:06:43Z",
    "anthropic-ratelimit-input-tokens-limit": "40000",
    "anthropic-ratelimit-input-tokens-remaining": "39000",
    "anthropic-ratelimit-input-tokens-reset": "2025-06-15T15:06:41.5Z",
    "anthropic-ratelimit-output-tokens-limit": "10000",
    "anthropic-ratelimit-output-tokens-remaining": "9000",
    "anthropic-ratelimit-output-tokens-reset": "2025-06-15T15:06:42+00:00",
    "request-id": "req_018EeWyXxfu5pfWkrYcMdjWG",
}


@pytest.mark.parametrize("style", ["anthropic", "auto"])
def test_anthropic_headers_with_rfc3339_resets(style: str) -> None:
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": "Number of ..."}}
    limits = parse_limits(ANTHROPIC, now=NOW, status=429, body=body, style=style)  # type: ignore[arg-type]
    requests = window(limits, "requests", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (50, 0, 12)
    assert reset_in(window(limits, "tokens", MINUTE)) == 3
    assert reset_in(window(limits, "input_tokens", MINUTE)) == 1.5
    output = window(limits, "output_tokens", MINUTE)
    assert (output.limit, output.remaining, reset_in(output)) == (10000, 9000, 2)
    assert limits.retry_after() == 12.0
    assert not limits.quota_exhausted
    assert limits.sources == ("retry-after", "anthropic")


def test_style_names_the_one_dialect_read() -> None:
    mixed = {**ANTHROPIC, **OPENAI_DOCS}
    assert {w.kind for w in parse_limits(mixed, now=NOW, style="anthropic").windows} == {
        "requests",
        "tokens",
        "input_tokens",
        "output_tokens",
    }
    openai = parse_limits(mixed, now=NOW, style="openai")
    assert window(openai, "requests", MINUTE).limit == 60
    assert openai.find("input_tokens") is None
    assert openai.retry_at == NOW + 12  # retry-after is read whatever the style


# ------------------------------------------------------------------ Gemini

#: A free-tier 429 as recorded in a bug report (googleapis/python-genai#2044).
GEMINI_429 = {
    "error": {
        "code": 429,
        "message": "You exceeded your current quota, please check your plan and billing "
        "details. For more information on this error, head to: "
        "https://ai.google.dev/gemini-api/docs/rate-limits.",
        "status": "RESOURCE_EXHAUSTED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                "violations": [
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_requests",
                        "quotaId": "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
                        "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                        "quotaValue": "200",
                    },
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_requests",
                        "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                        "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                        "quotaValue": "15",
                    },
                    {
                        "quotaMetric": "generativelanguage.googleapis.com/"
                        "generate_content_free_tier_input_token_count",
                        "quotaId": "GenerateContentInputTokensPerModelPerMinute-FreeTier",
                        "quotaDimensions": {"location": "global", "model": "gemini-2.0-flash"},
                    },
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
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "47s"},
        ],
    }
}

#: The next midnight in US Pacific after NOW: 2025-06-16T00:00-07:00.
PACIFIC_MIDNIGHT = datetime(2025, 6, 16, 7, tzinfo=UTC).timestamp()


def test_gemini_quota_failure_and_retry_info() -> None:
    limits = parse_limits({}, now=NOW, status=429, body=GEMINI_429, style="gemini")
    per_day = window(limits, "requests", DAY)
    per_minute = window(limits, "requests", MINUTE)
    tokens = window(limits, "input_tokens", MINUTE)
    assert (per_day.limit, per_day.remaining, per_day.reset_at) == (200, 0, PACIFIC_MIDNIGHT)
    assert (per_minute.limit, per_minute.remaining, reset_in(per_minute)) == (15, 0, 47)
    assert (tokens.limit, tokens.remaining) == (None, 0)
    assert limits.retry_at == NOW + 47
    assert limits.quota_exhausted  # a per-day quota id
    assert limits.quota_exhausted_until == PACIFIC_MIDNIGHT


def test_gemini_per_minute_only_is_a_wait() -> None:
    body = {
        "error": {
            "code": 429,
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": "generativelanguage.googleapis.com/"
                            "generate_requests_per_model",
                            "quotaId": "GenerateRequestsPerMinutePerProjectPerModel",
                        }
                    ],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1.5s"},
            ],
        }
    }
    limits = parse_limits({}, now=NOW, status=429, body=body)
    assert not limits.quota_exhausted
    assert reset_in(window(limits, "requests", MINUTE)) == 1.5
    assert limits.retry_after() == 1.5


def test_gemini_openai_compatible_endpoint_wraps_the_error_in_a_list() -> None:
    limits = parse_limits({}, now=NOW, status=429, body=[GEMINI_429])
    assert limits.quota_exhausted
    assert limits.retry_at == NOW + 47


def test_gemini_daily_quota_from_the_metric_when_the_id_is_missing() -> None:
    body = {
        "error": {
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [
                        {
                            "quotaMetric": "generativelanguage.googleapis.com/"
                            "generate_requests_per_model_per_day"
                        }
                    ],
                }
            ]
        }
    }
    limits = parse_limits({}, now=NOW, status=429, body=body)
    assert window(limits, "requests", DAY).reset_at == PACIFIC_MIDNIGHT
    assert limits.quota_exhausted


def test_pacific_midnight_in_winter_is_eight_hours_after_utc_midnight() -> None:
    winter = datetime(2025, 1, 10, 9, 30, tzinfo=UTC).timestamp()  # 01:30 PST
    limits = parse_limits({}, now=winter, status=429, body=GEMINI_429)
    assert limits.quota_exhausted_until == datetime(2025, 1, 11, 8, tzinfo=UTC).timestamp()


def test_a_success_body_is_not_read() -> None:
    assert parse_limits({}, now=NOW, status=200, body=GEMINI_429).empty


# -------------------------------------------------------------------- IETF


def test_ietf_policy_and_state_paired_by_name() -> None:
    headers = {
        "RateLimit-Policy": (
            '"burst";q=100;w=60, "daily";q=1000;w=86400, "bytes";q=9;qu="content-bytes"'
        ),
        "RateLimit": '"burst";r=50;t=30, "daily";r=870;t=36000',
    }
    limits = parse_limits(headers, now=NOW, style="ietf")
    burst = window(limits, "requests", MINUTE)
    daily = window(limits, "requests", DAY)
    assert (burst.limit, burst.remaining, reset_in(burst)) == (100, 50, 30)
    assert (daily.limit, daily.remaining, reset_in(daily)) == (1000, 870, 36000)
    assert len(limits.windows) == 2  # content bytes are not a quota we track
    assert not limits.quota_exhausted


def test_ietf_draft_example_and_a_token_policy() -> None:
    headers = {
        "RateLimit-Policy": '"default";q=100;w=10, "tpm";q=6000;w=60;qu="tokens"',
        "RateLimit": '"default";r=0;t=7, "tpm";r=1200;t=25',
    }
    limits = parse_limits(headers, now=NOW)
    default = window(limits, "requests", 10)
    tokens = window(limits, "tokens", MINUTE)
    assert (default.limit, default.remaining, reset_in(default)) == (100, 0, 7)
    assert (tokens.limit, tokens.remaining, reset_in(tokens)) == (6000, 1200, 25)
    assert limits.retry_after() == 7


def test_ietf_daily_policy_at_zero_is_quota_exhausted() -> None:
    headers = {"RateLimit-Policy": '"day";q=1000;w=86400', "RateLimit": '"day";r=0;t=3600'}
    limits = parse_limits(headers, now=NOW)
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until == NOW + 3600


def test_ietf_state_without_a_policy_and_a_policy_without_state() -> None:
    limits = parse_limits({"RateLimit": '"p";r=5;t=2'}, now=NOW)
    only_state = window(limits, "requests", None)
    assert (only_state.limit, only_state.remaining, reset_in(only_state)) == (None, 5, 2)
    limits = parse_limits({"RateLimit-Policy": '"p";q=5;w=1'}, now=NOW)
    only_policy = window(limits, "requests", 1)
    assert (only_policy.limit, only_policy.remaining, only_policy.reset_at) == (5, None, None)


def test_ietf_older_trio() -> None:
    headers = {
        "RateLimit-Limit": "100, 100;w=60",
        "RateLimit-Remaining": "7",
        "RateLimit-Reset": "12",
    }
    requests = window(parse_limits(headers, now=NOW), "requests", MINUTE)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (100, 7, 12)


def test_ietf_draft_07_dictionary() -> None:
    headers = {"RateLimit": "limit=100, remaining=50, reset=5", "RateLimit-Policy": "100;w=10"}
    requests = window(parse_limits(headers, now=NOW), "requests", 10)
    assert (requests.limit, requests.remaining, reset_in(requests)) == (100, 50, 5)


def test_ietf_quoted_commas_and_garbage_parameters() -> None:
    headers = {
        "RateLimit-Policy": '"a,b";q=10;w=60, "c";q=-3;w=x, ;;, "d";q',
        "RateLimit": '"a,b";r=4;t=1.5, "c";r=9',
    }
    limits = parse_limits(headers, now=NOW)
    ab = window(limits, "requests", MINUTE)
    assert (ab.limit, ab.remaining, reset_in(ab)) == (10, 4, 1.5)
    c = window(limits, "requests", None)
    assert (c.limit, c.remaining) == (None, 9)


# ------------------------------------------------------------- retry-after


def test_retry_after_ms_is_preferred_to_retry_after() -> None:
    limits = parse_limits({"retry-after-ms": "1500", "retry-after": "2"}, now=NOW)
    assert limits.retry_at == NOW + 1.5
    assert limits.sources == ("retry-after-ms",)
    assert parse_limits({"retry-after": "2"}, now=NOW).retry_after() == 2.0
    assert parse_limits({"Retry-After": "0.25"}, now=NOW).retry_after() == 0.25
    assert parse_limits({}, now=NOW).retry_after() is None


def test_retry_after_http_date() -> None:
    later = format_datetime(datetime.fromtimestamp(NOW + 3600, UTC), usegmt=True)
    assert parse_limits({"retry-after": later}, now=NOW).retry_at == NOW + 3600
    earlier = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert parse_limits({"retry-after": earlier}, now=NOW).retry_at == NOW


@pytest.mark.parametrize("value", ["soon", "-5", "", "nan", "Wed, 99 Foo 2015", "1e9999"])
def test_unreadable_retry_after_is_ignored(value: str) -> None:
    assert parse_limits({"retry-after": value, "retry-after-ms": value}, now=NOW).retry_at is None


def test_retry_after_falls_back_to_the_exhausted_quotas_reset() -> None:
    headers = {
        "x-ratelimit-remaining-requests": "5",
        "x-ratelimit-reset-requests": "2s",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert parse_limits(headers, now=NOW).retry_after() == 360
    neither = {**headers, "x-ratelimit-remaining-tokens": "9"}
    # Not knowing which: the tokens (a request may need more than 9), not the
    # requests, of which 5 are left.
    assert parse_limits(neither, now=NOW).retry_after() == 360
    unknown = {**neither, "x-ratelimit-remaining-tokens": "x", "x-ratelimit-reset-requests": "9m"}
    assert parse_limits(unknown, now=NOW).retry_after() == 360


def test_a_429_from_an_unreported_limit_does_not_wait_for_the_daily_reset() -> None:
    """Cerebras refusing on its per-minute request limit, which it does not report."""
    limits = parse_limits(CEREBRAS, now=NOW, status=429)
    assert limits.retry_after() == pytest.approx(11.383, abs=1e-3)  # tokens/minute, not the day
    only_day = {k: v for k, v in CEREBRAS.items() if "requests-day" in k}
    assert parse_limits(only_day, now=NOW, status=429).retry_after() is None


# ------------------------------------------------------- quota exhaustion

#: OpenAI's out-of-credit 429.
INSUFFICIENT_QUOTA = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing "
        "details. For more information on this error, read the docs: "
        "https://platform.openai.com/docs/guides/error-codes/api-errors.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}


@pytest.mark.parametrize("style", ["auto", "openai", "groq", "anthropic"])
def test_insufficient_quota_is_exhausted_until_unknown(style: str) -> None:
    limits = parse_limits({}, now=NOW, status=429, body=INSUFFICIENT_QUOTA, style=style)  # type: ignore[arg-type]
    assert limits.quota_exhausted
    assert limits.quota_exhausted_until is None
    assert "insufficient_quota" in limits.sources


def test_an_ordinary_rate_limit_error_is_not_exhaustion() -> None:
    body = {
        "error": {
            "message": "Rate limit reached",
            "type": "requests",
            "code": "rate_limit_exceeded",
        }
    }
    assert not parse_limits({}, now=NOW, status=429, body=body).quota_exhausted


# ---------------------------------------------------------- hostile input

KNOWN_NAMES = [
    *OPENAI_DOCS,
    *CEREBRAS,
    *ANTHROPIC,
    "x-groq-region",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "ratelimit",
    "ratelimit-policy",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "retry-after",
    "retry-after-ms",
]
KNOWN_KEYS = [
    "error",
    "details",
    "@type",
    "violations",
    "quotaId",
    "quotaMetric",
    "quotaValue",
    "retryDelay",
    "metadata",
    "headers",
    "message",
    "code",
    "type",
    "X-RateLimit-Reset",
    "X-RateLimit-Remaining",
]
VALUE_TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "0",
            "-1",
            "1e308",
            "nan",
            "inf",
            "1h2m3.5s",
            "99999999999999999999999",
            '"a";q=1;w=60',
            '"a";r=0;t=9999999999999',
            "2025-06-15T15:06:52Z",
            "9999-12-31T23:59:59Z",
            "Wed, 21 Oct 2015 07:28:00 GMT",
            "type.googleapis.com/google.rpc.RetryInfo",
            "type.googleapis.com/google.rpc.QuotaFailure",
            "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
            "insufficient_quota",
            "free-models-per-day",
            "999999999999999999s",
        ]
    ),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
HEADERS = st.dictionaries(
    st.one_of(
        st.sampled_from(KNOWN_NAMES),
        st.sampled_from(KNOWN_NAMES).map(str.upper),
        st.text(max_size=20),
    ),
    VALUE_TEXT,
    max_size=12,
)
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2**63, 2**63 - 1, -1]),  # beyond any float or int64
    st.floats(allow_nan=True, allow_infinity=True),
    VALUE_TEXT,
)
BODY = st.recursive(
    JSON_LEAF,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=8)), children, max_size=5
        ),
    ),
    max_leaves=30,
)
BODIES = st.one_of(BODY, st.binary(max_size=64), st.text(max_size=64))

EXAMPLES = int(os.environ.get("RENQUEUE_PROPERTY_EXAMPLES", "200"))


def check_sane(limits: LearnedLimits, now: float) -> None:
    assert limits.at == now
    for entry in limits.windows:
        for count in (entry.limit, entry.remaining):
            assert count is None or 0 <= count < 2**63
        assert entry.window is None or (math.isfinite(entry.window) and entry.window > 0)
        assert entry.reset_at is None or (math.isfinite(entry.reset_at) and entry.reset_at >= now)
    for at in (limits.retry_at, limits.quota_exhausted_until):
        assert at is None or (math.isfinite(at) and at >= now)
    delay = limits.retry_after()
    assert delay is None or (math.isfinite(delay) and delay >= 0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    headers=HEADERS,
    body=BODIES,
    status=st.one_of(st.none(), st.sampled_from([200, 400, 429, 503])),
    style=st.sampled_from(
        ["auto", "openai", "groq", "cerebras", "openrouter", "anthropic", "gemini", "ietf"]
    ),
    now=st.floats(min_value=0, max_value=4e9),
)
def test_any_headers_and_body_parse_without_raising_into_sane_values(
    headers: dict[str, str], body: Any, status: int | None, style: Any, now: float
) -> None:
    check_sane(parse_limits(headers, now=now, status=status, body=body, style=style), now)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    headers=HEADERS,
    style=st.sampled_from(
        ["auto", "openai", "groq", "cerebras", "openrouter", "anthropic", "gemini", "ietf"]
    ),
)
def test_a_success_whose_header_names_say_nothing_of_limits_has_none(
    headers: dict[str, str], style: Any
) -> None:
    """The adapters read a success's headers only when :func:`names_limits`
    finds a name that may say something of limits: without one, a success
    has nothing :func:`parse_limits` would read."""
    raw = [(name.encode(), value.encode()) for name, value in headers.items()]
    if not names_limits(raw):
        assert parse_limits(headers, now=NOW, status=200, style=style).empty


def test_the_names_that_may_say_something_of_limits() -> None:
    assert names_limits([(b"X-RateLimit-Remaining-Requests", b"5")])
    assert names_limits([(b"content-type", b"text/plain"), (b"Retry-After", b"3")])
    assert not names_limits([(b"content-type", b"text/event-stream"), (b"x-request-id", b"r")])
    assert not names_limits([])


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    headers=HEADERS,
    body=BODIES,
    style=st.sampled_from(["auto", "openrouter", "gemini"]),
)
def test_hostile_bodies_inside_known_shapes(headers: dict[str, str], body: Any, style: Any) -> None:
    for shaped in (
        {
            "error": {
                "details": [
                    body,
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": body},
                ]
            }
        },
        {
            "error": {
                "details": [
                    {
                        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                        "violations": [
                            body,
                            {"quotaId": body, "quotaValue": body},
                            {"quotaId": "GenerateRequestsPerDayPerProject", "quotaValue": body},
                        ],
                    }
                ]
            }
        },
        {"error": {"message": body, "metadata": {"headers": body}}},
        {
            "error": {
                "metadata": {"headers": {"X-RateLimit-Reset": body, "X-RateLimit-Limit": body}}
            }
        },
        [body],
    ):
        check_sane(parse_limits(headers, now=NOW, status=429, body=shaped, style=style), NOW)
