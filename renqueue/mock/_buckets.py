"""The mock's declared rate limits, as token buckets (``rpm``, ``tpm``, ``rpd``).

Token buckets, as OpenAI describes its own: ``rpm = N`` means a bucket of
``N`` requests refilled continuously at ``N / 60`` per second (the same for
``tpm`` and tokens, and for ``rpd`` over a day); the reset reported is the
time until the bucket is full again. :class:`DeclaredLimits` charges
requests to them and reads them as :class:`~._rate_limits.Quota` s, which
:mod:`._rate_limits` writes as a provider's headers and 429 bodies.
"""

from __future__ import annotations

import math
import time
from typing import Final

from ._rate_limits import MockLimitStyle, Quota, limit_headers, quota_exhausted, rate_limited
from ._settings import MockSettings

__all__ = ["DeclaredLimits"]

#: The window rpd is counted over.
_DAY: Final = 86400.0


class _Bucket:
    """A token bucket: ``capacity`` per ``window`` seconds, refilled continuously."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, capacity: int, window: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / window
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait(self, need: int) -> float:
        """Seconds until ``need`` fits (0 if it fits now)."""
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def reset(self) -> float:
        return (self.capacity - self.level) / self.rate


class DeclaredLimits:
    """The buckets of the declared limits, and the headers and 429s they make.

    Every answer is a ``(headers, body)`` pair in the rate-limit dialect
    ``style`` (:mod:`._rate_limits`), as of now.
    """

    def __init__(self) -> None:
        self._window = 60.0
        self._requests: _Bucket | None = None
        self._tokens: _Bucket | None = None
        self._daily: _Bucket | None = None

    def apply(self, settings: MockSettings, old: MockSettings, *, fresh: bool) -> None:
        """Take ``settings`` (``old`` were in force; ``fresh``: none were):
        a limit that changed starts with a full bucket."""
        now = time.monotonic()
        window_changed = settings.rate_window != old.rate_window
        if fresh or settings.rpm != old.rpm or window_changed:
            self._requests = (
                _Bucket(settings.rpm, settings.rate_window, now) if settings.rpm else None
            )
        if fresh or settings.tpm != old.tpm or window_changed:
            self._tokens = (
                _Bucket(settings.tpm, settings.rate_window, now) if settings.tpm else None
            )
        if fresh or settings.rpd != old.rpd:
            self._daily = _Bucket(settings.rpd, _DAY, now) if settings.rpd else None
        self._window = settings.rate_window

    def _buckets(self) -> list[tuple[str, float, _Bucket]]:
        """The declared buckets, as (kind, window, bucket)."""
        return [
            (kind, window, bucket)
            for kind, window, bucket in (
                ("requests", self._window, self._requests),
                ("tokens", self._window, self._tokens),
                ("requests", _DAY, self._daily),
            )
            if bucket is not None
        ]

    def quotas(self) -> list[Quota]:
        """Every declared bucket as of now (refilled), for the limit headers."""
        now = time.monotonic()
        quotas = []
        for kind, window, bucket in self._buckets():
            bucket.refill(now)
            quotas.append(_quota(kind, window, bucket))
        return quotas

    def headers(self, style: MockLimitStyle) -> dict[str, str]:
        """The rate-limit headers for the declared limits."""
        return limit_headers(style, self.quotas(), time.time())

    def take(
        self, style: MockLimitStyle, tokens: int, model: str
    ) -> tuple[dict[str, str], bytes] | None:
        """Charge one request and ``tokens``; the 429 if any bucket lacks room
        (then nothing is charged)."""
        now = time.monotonic()
        waits: list[tuple[float, str, float, _Bucket, int]] = []
        for kind, window, bucket in self._buckets():
            need = tokens if kind == "tokens" else 1
            bucket.refill(now)
            waits.append((bucket.wait(need), kind, window, bucket, need))
        blocked = [entry for entry in waits if entry[0] > 0]
        if not blocked:
            for *_, bucket, need in waits:
                bucket.level -= need
            return None
        wait, kind, window, bucket, need = max(blocked, key=lambda entry: entry[0])
        quotas = [_quota(k, w, b) for _, k, w, b, _ in waits]
        return rate_limited(
            style,
            quotas,
            _quota(kind, window, bucket),
            wait=wait,
            need=need,
            model=model,
            now=time.time(),
        )

    def exhausted(
        self, style: MockLimitStyle, *, daily: int, model: str
    ) -> tuple[dict[str, str], bytes]:
        """The quota-exhausted 429 (``daily``: the declared requests per day)."""
        return quota_exhausted(style, self.quotas(), daily=daily, model=model, now=time.time())

    def refused_for(
        self, style: MockLimitStyle, *, wait: float, capacity: int, model: str, bare: bool
    ) -> tuple[dict[str, str], bytes]:
        """The 429 of a per-minute request bucket of ``capacity`` empty for
        ``wait`` seconds (an injected ``429``); with a ``retry-after`` header,
        or (``bare``) without any."""
        blocked = Quota(kind="requests", window=60.0, capacity=capacity, remaining=0, reset=wait)
        headers, payload = rate_limited(
            style,
            self.quotas(),
            blocked,
            wait=wait,
            need=1,
            model=model,
            now=time.time(),
        )
        retry = {"retry-after", "retry-after-ms"}
        headers = {k: v for k, v in headers.items() if k.lower() not in retry}
        if not bare:
            headers["retry-after"] = str(math.ceil(wait))
            if style == "openai":
                headers["retry-after-ms"] = str(math.ceil(wait * 1000))
        return headers, payload


def _quota(kind: str, window: float, bucket: _Bucket) -> Quota:
    return Quota(
        kind="tokens" if kind == "tokens" else "requests",
        window=window,
        capacity=bucket.capacity,
        remaining=int(bucket.level),
        reset=bucket.reset(),
    )
