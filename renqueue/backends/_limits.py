"""What a provider says about our rate limits, read from one response: pure parsers.

Providers report limits in a handful of dialects. :func:`parse_limits` reads
any of them from a response's headers (and, for 429s, its decoded error body)
into one typed :class:`LearnedLimits`: a tuple of :class:`LimitWindow` s (a
kind of quota, its window, the limit, what is left, and when it is full
again), when to retry, and whether the quota is exhausted for the day.

Every time in the result is **absolute** (Unix seconds), computed from the
``now`` the caller passes: a relative reset (``6m0s``, ``33011.38``, ``t=30``)
becomes ``now + delay``, an absolute one (RFC 3339, epoch milliseconds, an
HTTP-date) is taken as given. Absolute times are never before ``now`` (a reset
already past means "full now"), so a reading can travel in an event and be
folded by any process or replay without a clock.

The dialects (``style``; ``"auto"`` reads every one it finds):

==============  ==============================================================
``openai``      ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``,
                resets as Go durations (``6m0s``, ``1.5s``, ``12ms``); both
                per minute (RPM, TPM).
``groq``        the same names, but the *requests* headers count per **day**
                (RPD); tokens per minute. ``auto`` picks it when the response
                carries ``x-groq-region``.
``cerebras``    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}-{minute,
                hour,day}``, resets in (float) seconds.
``openrouter``  ``X-RateLimit-{Limit,Remaining,Reset}`` (requests; reset in epoch
                milliseconds), on the response or only inside a 429 body's
                ``error.metadata.headers``; the message names the window
                (``free-models-per-day``, ``free-models-per-min``).
``anthropic``   ``anthropic-ratelimit-{requests,tokens,input-tokens,
                output-tokens}-{limit,remaining,reset}``, RFC 3339 resets, per
                minute.
``gemini``      a 429 body's ``error.details``: ``google.rpc.RetryInfo``
                ``retryDelay`` (``"37s"``) and ``google.rpc.QuotaFailure``
                ``violations[].quotaId`` naming kind and window
                (``GenerateRequestsPerDayPerProjectPerModel-FreeTier``).
``ietf``        ``RateLimit-Policy: "default";q=100;w=60`` with ``RateLimit:
                "default";r=50;t=30`` (draft-ietf-httpapi-ratelimit-headers),
                and the older ``RateLimit-Limit/-Remaining/-Reset`` trio.
==============  ==============================================================

Always read, whatever the style: ``retry-after-ms``, ``retry-after`` (seconds
or an HTTP-date), and an OpenAI-shaped error whose code is
``insufficient_quota``.

**Quota exhausted** (:attr:`LearnedLimits.quota_exhausted`): an
``insufficient_quota`` error (until unknown: billing), a Gemini violation of a
per-day quota (until the next midnight US Pacific, when Gemini's daily quotas
reset), or any window of a day or longer with nothing remaining (Groq and
Cerebras daily counters, OpenRouter's ``free-models-per-day``; until that
window's reset).

**Hostile input never raises.** Every field is read on its own; anything
unreadable (not a number, negative, non-finite, absurdly far away) is ``None``
or skipped, and the rest of the reading stands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from email.utils import parsedate_to_datetime
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from msgspec import Struct

from ..config import LimitStyle
from ..schema import ReportedLimit

__all__ = [
    "DAY",
    "HOUR",
    "MINUTE",
    "LearnedLimits",
    "LimitKind",
    "LimitWindow",
    "names_limits",
    "parse_limits",
    "reported",
]

#: What a quota counts.
LimitKind = Literal["requests", "tokens", "input_tokens", "output_tokens"]

MINUTE: Final = 60.0
HOUR: Final = 3600.0
DAY: Final = 86400.0

#: A delay or reset further away than this is taken as garbage, not as a time.
_MAX_DELAY: Final = 400 * DAY
#: Counts above this are garbage (and would not fit an int64 in an event).
_MAX_COUNT: Final = 2**63 - 1
#: A bare number this large is a Unix time in milliseconds / seconds, not a delay.
_EPOCH_MILLISECONDS: Final = 1e11
_EPOCH_SECONDS: Final = 1e9


class LimitWindow(Struct, frozen=True, kw_only=True):
    """One quota as the provider reported it.

    ``window`` is its length in seconds (:data:`MINUTE`, :data:`DAY`, ...),
    ``None`` when the format does not say. ``reset_at`` is the Unix time the
    quota is full again (for a token bucket: refilled), never before the
    reading's ``at``. A field is ``None`` when absent or unreadable.
    """

    kind: LimitKind
    window: float | None = None
    limit: int | None = None
    remaining: int | None = None
    reset_at: float | None = None


class LearnedLimits(Struct, frozen=True, kw_only=True):
    """Everything one response said about our limits, as of ``at`` (Unix time).

    - ``windows``: the quotas reported, one per (kind, window), in the order read.
    - ``retry_at``: when the provider asked us to retry (``retry-after-ms``,
      ``retry-after``, Gemini's ``RetryInfo``), if it did.
    - ``quota_exhausted``: the quota is gone for a long time (a day, or until
      billing changes), so waiting a few seconds and retrying is pointless;
      ``quota_exhausted_until`` is when it comes back, ``None`` if unknown.
    - ``sources``: the formats the reading came from (``"openai"``,
      ``"retry-after"``, ``"gemini"``, ...), for logs and tests.
    """

    at: float
    windows: tuple[LimitWindow, ...] = ()
    retry_at: float | None = None
    quota_exhausted: bool = False
    quota_exhausted_until: float | None = None
    sources: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """The response said nothing about limits."""
        return not self.windows and self.retry_at is None and not self.quota_exhausted

    def find(self, kind: LimitKind, window: float | None = None) -> LimitWindow | None:
        """The first window of ``kind`` (of length ``window``, if given)."""
        for entry in self.windows:
            if entry.kind == kind and (window is None or entry.window == window):
                return entry
        return None

    def retry_after(self) -> float | None:
        """Seconds from ``at`` to wait before the next call, rounded to the millisecond.

        ``retry_at`` when the provider gave one; else the latest reset of the
        windows with nothing remaining; else (a 429 that does not say which
        quota it hit) the latest reset of the windows that could have refused:
        not a request window with requests left (a token window with tokens
        left still can, for a request needing more). ``None`` when nothing
        says: the caller picks its own backoff.
        """
        if self.retry_at is not None:
            return _rounded(self.retry_at - self.at)
        resets = [w.reset_at for w in self.windows if w.remaining == 0 and w.reset_at is not None]
        if not resets:
            resets = [
                w.reset_at
                for w in self.windows
                if w.reset_at is not None
                and not (w.kind == "requests" and w.remaining is not None and w.remaining > 0)
            ]
        return _rounded(max(resets) - self.at) if resets else None


def _rounded(seconds: float) -> float:
    return max(round(seconds, 3), 0.0)


# ------------------------------------------------------------------ values


def _count(value: object) -> int | None:
    """A non-negative count: ``"60"``, ``"149984"``, ``"7.0"`` (floored); else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        # Not through float: an int too large for one would raise there.
        return value if 0 <= value <= _MAX_COUNT else None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        if not _NUMBER_RE.fullmatch(text):
            return None
        number = float(text)
    else:
        return None
    if not math.isfinite(number) or number < 0 or number > _MAX_COUNT:
        return None
    return int(number)


_NUMBER_RE: Final = re.compile(r"\+?(?:\d+(?:\.\d*)?|\.\d+)")
#: Go's duration units; it prints microseconds with U+00B5 and also reads U+03BC.
_GO_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_GO_PART: Final = (
    r"(\d+(?:\.\d*)?|\.\d+)(" + "|".join(sorted(_GO_UNITS, key=len, reverse=True)) + ")"
)
_GO_PART_RE: Final = re.compile(_GO_PART)
_GO_FULL_RE: Final = re.compile(f"(?:{_GO_PART})+")
_PROTO_DURATION_RE: Final = re.compile(r"(\d+(?:\.\d+)?)s")


def _number(text: str) -> float | None:
    text = text.strip()
    if not _NUMBER_RE.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _after(now: float, delay: float | None) -> float | None:
    """``now + delay`` for a usable delay, else ``None``."""
    if delay is None or not math.isfinite(delay) or delay < 0 or delay > _MAX_DELAY:
        return None
    return now + delay


def _not_before(now: float, when: float | None) -> float | None:
    """An absolute time, moved up to ``now`` if already past; ``None`` if absurd."""
    if when is None or not math.isfinite(when) or when - now > _MAX_DELAY:
        return None
    return max(when, now)


def _go_duration(text: str) -> float | None:
    """Seconds in a Go duration: ``"6m0s"``, ``"1.5s"``, ``"12ms"``, ``"1h2m3.5s"``."""
    text = text.strip()
    if text == "0":
        return 0.0
    if not _GO_FULL_RE.fullmatch(text):
        return None
    return sum(float(amount) * _GO_UNITS[unit] for amount, unit in _GO_PART_RE.findall(text))


def _bare_or_epoch(number: float, now: float) -> float | None:
    """A bare number as a reset: epoch milliseconds or seconds if that large, else a delay."""
    if number >= _EPOCH_MILLISECONDS:
        return _not_before(now, number / 1000)
    if number >= _EPOCH_SECONDS:
        return _not_before(now, number)
    return _after(now, number)


def _reset_duration(text: str | None, now: float) -> float | None:
    """A relative reset (Go duration or bare seconds; a huge bare number is a Unix time)."""
    if text is None:
        return None
    number = _number(text)
    if number is not None:
        return _bare_or_epoch(number, now)
    return _after(now, _go_duration(text))


def _datetime_seconds(when: datetime) -> float | None:
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        return when.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _rfc3339(text: str) -> float | None:
    text = text.strip()
    if not text or len(text) > 64:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return _datetime_seconds(when)


def _http_date(text: str) -> float | None:
    text = text.strip()
    if not text or len(text) > 64:
        return None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return _datetime_seconds(when)


def _reset_any(text: str | None, now: float) -> float | None:
    """A reset in whatever form: a number (delay or Unix time), a Go duration,
    RFC 3339 or an HTTP-date."""
    if text is None:
        return None
    reset = _reset_duration(text, now)
    if reset is not None:
        return reset
    when = _rfc3339(text)
    if when is None:
        when = _http_date(text)
    return _not_before(now, when)


def _pacific() -> tzinfo:
    """US Pacific, where Gemini's daily quotas reset at midnight. Without the tz
    database, standard time: an hour late in summer, never early."""
    try:
        return ZoneInfo("America/Los_Angeles")
    except ZoneInfoNotFoundError:  # pragma: no cover - depends on the system's tz data
        return timezone(timedelta(hours=-8))


_PACIFIC: Final = _pacific()


def _next_pacific_midnight(now: float) -> float | None:
    """The first midnight in US Pacific time after ``now``."""
    try:
        local = datetime.fromtimestamp(now, _PACIFIC)
    except (OverflowError, OSError, ValueError):
        return None
    day = (local + timedelta(days=1)).date()
    midnight = datetime(day.year, day.month, day.day, tzinfo=_PACIFIC)
    return _not_before(now, midnight.timestamp())


# ----------------------------------------------------------------- reading


class _Reading:
    """What the parsers found so far, one response's worth."""

    __slots__ = ("exhausted", "now", "retry_at", "sources", "untils", "windows")

    def __init__(self, now: float) -> None:
        self.now = now
        self.windows: dict[tuple[str, float | None], LimitWindow] = {}
        self.retry_at: float | None = None
        self.exhausted = False
        self.untils: list[float] = []
        self.sources: list[str] = []

    def add(self, source: str, window: LimitWindow) -> None:
        """Record one window (the first reading of a (kind, window) wins)."""
        if window.limit is None and window.remaining is None and window.reset_at is None:
            return
        self.windows.setdefault((window.kind, window.window), window)
        self.source(source)

    def source(self, name: str) -> None:
        if name not in self.sources:
            self.sources.append(name)

    def exhaust(self, until: float | None) -> None:
        self.exhausted = True
        if until is not None:
            self.untils.append(until)

    def result(self) -> LearnedLimits:
        windows = tuple(self.windows.values())
        for window in windows:
            # A day (or longer) with nothing left: no point retrying before it resets.
            if window.window is not None and window.window >= DAY and window.remaining == 0:
                self.exhaust(window.reset_at)
        return LearnedLimits(
            at=self.now,
            windows=windows,
            retry_at=self.retry_at,
            quota_exhausted=self.exhausted,
            quota_exhausted_until=max(self.untils) if self.untils else None,
            sources=tuple(self.sources),
        )


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers with lower-case names, string values only."""
    return {
        name.strip().lower(): value
        for name, value in headers.items()
        if isinstance(name, str) and isinstance(value, str)
    }


def _decoded(body: object) -> object:
    """A JSON body, decoded if it came as bytes or text; ``None`` if unreadable."""
    if isinstance(body, bytes | bytearray | memoryview | str):
        try:
            return msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):  # JSON nested too deeply
            return None
    return body


def _error_of(body: object) -> dict[str, Any] | None:
    """The error object of an error body: ``{"error": {...}}``, Gemini's
    ``[{"error": {...}}]`` (its OpenAI-compatible endpoint), or a bare
    ``{"message", "type", "code"}`` object (Cerebras)."""
    if isinstance(body, list) and body:
        body = body[0]
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        return error
    return body


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


# --------------------------------------------------------------- dialects


def _read_retry(headers: dict[str, str], reading: _Reading) -> None:
    """``retry-after-ms`` (OpenAI), else ``retry-after`` (seconds or an HTTP-date)."""
    now = reading.now
    millis = headers.get("retry-after-ms")
    if millis is not None:
        number = _number(millis)
        if number is not None and (at := _after(now, number / 1000)) is not None:
            reading.retry_at = at
            reading.source("retry-after-ms")
            return
    value = headers.get("retry-after")
    if value is None:
        return
    number = _number(value)
    at = _after(now, number) if number is not None else _not_before(now, _http_date(value))
    if at is not None:
        reading.retry_at = at
        reading.source("retry-after")


#: ``x-ratelimit-*-requests`` / ``-tokens``: window of each kind, by dialect.
_OPENAI_WINDOWS: Final[dict[str, dict[LimitKind, float]]] = {
    "openai": {"requests": MINUTE, "tokens": MINUTE},
    "groq": {"requests": DAY, "tokens": MINUTE},
}


def _read_openai(headers: dict[str, str], reading: _Reading, dialect: str) -> None:
    for kind, window in _OPENAI_WINDOWS[dialect].items():
        reading.add(
            dialect,
            LimitWindow(
                kind=kind,
                window=window,
                limit=_count(headers.get(f"x-ratelimit-limit-{kind}")),
                remaining=_count(headers.get(f"x-ratelimit-remaining-{kind}")),
                reset_at=_reset_duration(headers.get(f"x-ratelimit-reset-{kind}"), reading.now),
            ),
        )


_SUFFIXED_RE: Final = re.compile(
    r"x-ratelimit-(limit|remaining|reset)-(requests|tokens|input-tokens|output-tokens)"
    r"-(second|minute|hour|day)"
)
_WINDOW_WORDS: Final = {"second": 1.0, "minute": MINUTE, "hour": HOUR, "day": DAY}
_KIND_WORDS: Final[dict[str, LimitKind]] = {
    "requests": "requests",
    "tokens": "tokens",
    "input-tokens": "input_tokens",
    "output-tokens": "output_tokens",
}


def _read_cerebras(headers: dict[str, str], reading: _Reading) -> None:
    """``x-ratelimit-limit-requests-day: 14400`` ... ``x-ratelimit-reset-tokens-minute: 11.38``."""
    found: dict[tuple[LimitKind, float], dict[str, str]] = {}
    for name, value in headers.items():
        match = _SUFFIXED_RE.fullmatch(name)
        if match is not None:
            field, kind, window = match.groups()
            found.setdefault((_KIND_WORDS[kind], _WINDOW_WORDS[window]), {})[field] = value
    for (kind, window), fields in found.items():
        reading.add(
            "cerebras",
            LimitWindow(
                kind=kind,
                window=window,
                limit=_count(fields.get("limit")),
                remaining=_count(fields.get("remaining")),
                reset_at=_reset_duration(fields.get("reset"), reading.now),
            ),
        )


_OPENROUTER_WINDOW_RE: Final = re.compile(r"per[-_ ](second|sec|minute|min|hour|day)\b")
_OPENROUTER_WINDOWS: Final = {
    "second": 1.0,
    "sec": 1.0,
    "minute": MINUTE,
    "min": MINUTE,
    "hour": HOUR,
    "day": DAY,
}


def _read_openrouter(
    headers: dict[str, str], error: dict[str, Any] | None, reading: _Reading
) -> None:
    """``X-RateLimit-Limit/-Remaining/-Reset`` on the response, else in the error's
    ``metadata.headers``; the window from the message (``free-models-per-day``)."""
    names = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")
    source = "openrouter"
    if not any(name in headers for name in names) and error is not None:
        metadata = error.get("metadata")
        inner = metadata.get("headers") if isinstance(metadata, dict) else None
        if isinstance(inner, dict):
            headers = {
                str(name).lower(): str(value)
                for name, value in inner.items()
                if isinstance(value, str | int | float) and not isinstance(value, bool)
            }
            source = "openrouter-body"
    if not any(name in headers for name in names):
        return
    window = None
    if error is not None:
        match = _OPENROUTER_WINDOW_RE.search(_text(error.get("message")).lower())
        if match is not None:
            window = _OPENROUTER_WINDOWS[match.group(1)]
    reading.add(
        source,
        LimitWindow(
            kind="requests",
            window=window,
            limit=_count(headers.get("x-ratelimit-limit")),
            remaining=_count(headers.get("x-ratelimit-remaining")),
            reset_at=_reset_any(headers.get("x-ratelimit-reset"), reading.now),
        ),
    )


_ANTHROPIC_KINDS: Final[dict[str, LimitKind]] = {
    "requests": "requests",
    "tokens": "tokens",
    "input-tokens": "input_tokens",
    "output-tokens": "output_tokens",
}


def _read_anthropic(headers: dict[str, str], reading: _Reading) -> None:
    """``anthropic-ratelimit-requests-reset: 2024-06-24T17:26:00Z`` and friends, per minute."""
    for word, kind in _ANTHROPIC_KINDS.items():
        prefix = f"anthropic-ratelimit-{word}-"
        reading.add(
            "anthropic",
            LimitWindow(
                kind=kind,
                window=MINUTE,
                limit=_count(headers.get(prefix + "limit")),
                remaining=_count(headers.get(prefix + "remaining")),
                reset_at=_reset_any(headers.get(prefix + "reset"), reading.now),
            ),
        )


_GEMINI_WINDOWS: Final = (
    ("persecond", 1.0),
    ("perminute", MINUTE),
    ("perhour", HOUR),
    ("perday", DAY),
)
_GEMINI_KINDS: Final[tuple[tuple[str, LimitKind], ...]] = (
    ("inputtoken", "input_tokens"),
    ("outputtoken", "output_tokens"),
    ("token", "tokens"),
    ("request", "requests"),
)


def _gemini_quota(violation: dict[str, Any]) -> tuple[LimitKind, float] | None:
    """Kind and window from a violation's ``quotaId`` (or ``quotaMetric``):
    ``GenerateRequestsPerDayPerProjectPerModel-FreeTier`` is requests per day."""
    name = (_text(violation.get("quotaId")) + " " + _text(violation.get("quotaMetric"))).lower()
    name = name.replace("_", "").replace("-", "")
    kind = next((k for word, k in _GEMINI_KINDS if word in name), None)
    window = next((w for word, w in _GEMINI_WINDOWS if word in name), None)
    if kind is None or window is None:
        return None
    return kind, window


def _gemini_details(details: list[Any], now: float) -> tuple[float | None, list[dict[str, Any]]]:
    """The ``RetryInfo`` retry time and the ``QuotaFailure`` violations."""
    retry_at = None
    violations: list[dict[str, Any]] = []
    for detail in details:
        if not isinstance(detail, dict):
            continue
        kind = _text(detail.get("@type"))
        if kind.endswith("google.rpc.RetryInfo"):
            match = _PROTO_DURATION_RE.fullmatch(_text(detail.get("retryDelay")).strip())
            if match is not None:
                retry_at = _after(now, float(match.group(1)))
        elif kind.endswith("google.rpc.QuotaFailure"):
            found = detail.get("violations")
            if isinstance(found, list):
                violations.extend(v for v in found if isinstance(v, dict))
    return retry_at, violations


def _read_gemini(error: dict[str, Any] | None, reading: _Reading) -> None:
    """``error.details``: ``RetryInfo.retryDelay`` and ``QuotaFailure.violations``."""
    details = error.get("details") if error is not None else None
    if not isinstance(details, list):
        return
    now = reading.now
    retry_at, violations = _gemini_details(details, now)
    if retry_at is not None:
        reading.source("gemini")
        if reading.retry_at is None:
            reading.retry_at = retry_at
    for violation in violations:
        quota = _gemini_quota(violation)
        if quota is None:
            continue
        kind, window = quota
        if window >= DAY:
            reset_at = _next_pacific_midnight(now)
            reading.exhaust(reset_at)
        else:
            reset_at = retry_at
        # A violation is a quota with nothing left.
        reading.add(
            "gemini",
            LimitWindow(
                kind=kind,
                window=window,
                limit=_count(violation.get("quotaValue")),
                remaining=0,
                reset_at=reset_at,
            ),
        )


_INSUFFICIENT_QUOTA: Final = "insufficient_quota"


def _read_quota_error(error: dict[str, Any] | None, reading: _Reading) -> None:
    """OpenAI's ``insufficient_quota``: out of credit, back only when billing changes."""
    if error is None:
        return
    if _INSUFFICIENT_QUOTA in (error.get("code"), error.get("type")):
        reading.exhaust(None)
        reading.source(_INSUFFICIENT_QUOTA)


# ---------------------------------------------------------------- IETF


_Param = str | int | float | bool


def _sf_members(text: str) -> list[tuple[_Param | None, dict[str, _Param]]]:
    """A lenient Structured Fields list (RFC 8941): members of ``item;key=value;...``.

    Strings (``"..."``), integers, decimals and tokens; a key without a value
    is ``True``. Anything it cannot read is a member with value ``None`` or a
    parameter left out; it never fails.
    """
    members: list[tuple[_Param | None, dict[str, _Param]]] = []
    for member in _split_outside_quotes(text[:8192], ","):
        parts = _split_outside_quotes(member, ";")
        if not parts or not parts[0].strip():
            continue
        first = parts[0].strip()
        params: dict[str, _Param] = {}
        if "=" in first and not first.startswith('"'):
            # draft-07 style: "limit=100" is a key, not an item.
            key, _, value = first.partition("=")
            params[key.strip().lower()] = _sf_bare(value)
            item: _Param | None = None
        else:
            item = _sf_bare(first)
        for part in parts[1:]:
            key, equals, value = part.partition("=")
            key = key.strip().lower()
            if key:
                params[key] = _sf_bare(value) if equals else True
        members.append((item, params))
    return members


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def _sf_bare(text: str) -> _Param:
    text = text.strip()
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if re.fullmatch(r"-?\d{1,15}", text):
        return int(text)
    if re.fullmatch(r"-?\d{1,12}\.\d{1,3}", text):
        return float(text)
    return text


def _param_number(value: _Param | None) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


#: The quota unit (``qu``) of a policy: ``requests`` by default; ``tokens``
#: (and ``input-tokens``/``output-tokens``) read as an extension; bytes and
#: concurrency are not quotas tracked here.
_IETF_UNITS: Final[dict[str, LimitKind]] = {
    "requests": "requests",
    "request": "requests",
    "tokens": "tokens",
    "input-tokens": "input_tokens",
    "output-tokens": "output_tokens",
}


def _read_ietf(headers: dict[str, str], reading: _Reading) -> None:
    """``RateLimit-Policy`` and ``RateLimit`` paired by policy name; the older
    drafts' unnamed forms as one requests window."""
    now = reading.now
    policies: dict[str, dict[str, _Param]] = {}
    unnamed: list[tuple[float, dict[str, _Param]]] = []  # older: "100;w=60"
    for item, params in _sf_members(headers.get("ratelimit-policy", "")):
        if isinstance(item, str):
            policies.setdefault(item, params)
        elif (limit := _param_number(item)) is not None:
            unnamed.append((limit, params))
    states: dict[str, dict[str, _Param]] = {}
    older: dict[str, _Param] = {}  # draft-07: "limit=100, remaining=50, reset=5"
    for item, params in _sf_members(headers.get("ratelimit", "")):
        if isinstance(item, str):
            states.setdefault(item, params)
        elif item is None:
            older.update(params)
    for name in [*policies, *(n for n in states if n not in policies)]:
        policy = policies.get(name, {})
        state = states.get(name, {})
        unit = policy.get("qu", "requests")
        kind = _IETF_UNITS.get(unit.lower()) if isinstance(unit, str) else None
        if kind is not None:
            reading.add(
                "ietf",
                LimitWindow(
                    kind=kind,
                    window=_param_number(policy.get("w")) or None,
                    limit=_count(_param_number(policy.get("q"))),
                    remaining=_count(_param_number(state.get("r"))),
                    reset_at=_after(now, _param_number(state.get("t"))),
                ),
            )
    # The older unnamed forms: draft-07's RateLimit dictionary, or the trio
    # RateLimit-Limit ("100", or "100, 100;w=60"), -Remaining, -Reset (seconds).
    trio = _sf_members(headers.get("ratelimit-limit", ""))
    remaining = headers.get("ratelimit-remaining")
    reset = headers.get("ratelimit-reset")
    if not (older or trio or remaining is not None or reset is not None):
        return
    window = next(
        (w for _, params in [*trio, *unnamed] if (w := _param_number(params.get("w")))), None
    )
    limit = _param_number(older.get("limit"))
    if limit is None and trio:
        limit = _param_number(trio[0][0])
    if limit is None and unnamed:
        limit = unnamed[0][0]
    reading.add(
        "ietf",
        LimitWindow(
            kind="requests",
            window=window,
            limit=_count(limit),
            remaining=_count(
                _param_number(older["remaining"]) if "remaining" in older else remaining
            ),
            reset_at=_after(
                now, _param_number(older["reset"]) if "reset" in older else _number(reset or "")
            ),
        ),
    )


# ------------------------------------------------------------------ entry


#: What the name of a header that may say something of limits holds (lower case).
_LIMIT_NAMES: Final = ("ratelimit", "retry-after")
_LIMIT_NAMES_RAW: Final = tuple(part.encode() for part in _LIMIT_NAMES)


def names_limits(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a header of ``headers`` (raw names and values) may say something
    of limits: without one, :func:`parse_limits` finds nothing in a success."""
    for name, _value in headers:
        lowered = name.lower()
        for part in _LIMIT_NAMES_RAW:
            if part in lowered:
                return True
    return False


def parse_limits(
    headers: Mapping[str, str],
    *,
    now: float,
    status: int | None = None,
    body: object = None,
    style: LimitStyle = "auto",
) -> LearnedLimits:
    """Read one response's rate-limit information; never raises.

    ``headers``: the response headers (any case). ``now``: the Unix time the
    response arrived; every relative time becomes absolute from it.
    ``status``: the HTTP status, if known (a body is read only for an error,
    400 and up, or when the status is unknown). ``body``: the error body,
    decoded JSON or its bytes/text. ``style``: the dialect (module
    docstring); ``"auto"`` reads every one it finds, telling Groq from OpenAI
    by ``x-groq-region``.
    """
    reading = _Reading(now)
    lowered = _lower(headers)
    error = _error_of(_decoded(body)) if status is None or status >= 400 else None
    if error is None and not any(part in name for name in lowered for part in _LIMIT_NAMES):
        return reading.result()  # the usual success response of a backend without limits
    _read_retry(lowered, reading)
    _read_quota_error(error, reading)
    auto = style == "auto"
    if style in ("openai", "groq") or auto:
        dialect = "groq" if style == "groq" or (auto and "x-groq-region" in lowered) else "openai"
        _read_openai(lowered, reading, dialect)
    if style == "cerebras" or auto:
        _read_cerebras(lowered, reading)
    if style == "openrouter" or auto:
        _read_openrouter(lowered, error, reading)
    if style == "anthropic" or auto:
        _read_anthropic(lowered, reading)
    if style == "gemini" or auto:
        _read_gemini(error, reading)
    if style == "ietf" or auto:
        _read_ietf(lowered, reading)
    return reading.result()


def reported(learned: LearnedLimits | None) -> tuple[ReportedLimit, ...]:
    """The windows of ``learned`` as they travel in events (nothing for ``None``)."""
    if learned is None:
        return ()
    return tuple(
        ReportedLimit(
            kind=window.kind,
            window=window.window,
            limit=window.limit,
            remaining=window.remaining,
            reset_at=window.reset_at,
        )
        for window in learned.windows
    )
