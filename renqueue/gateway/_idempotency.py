"""Retries that join the request they retry, instead of making a second one.

Two ways a retry is recognised:

- **An ``Idempotency-Key`` header.** The request id is derived from the key
  (:func:`id_for_key`), so every retry with that key, through any gateway
  process, names the same request: its publish carries the same JetStream
  message id ``<tenant>:<id>`` and is dropped as a duplicate within
  ``nats.duplicate_window`` (10 min by default), and the retry follows the
  original. Keys are scoped by tenant (the message id and every subject name
  the tenant), so two tenants may use the same key. Past the window JetStream
  no longer knows the id, so the gateway looks the request up in the event
  log first (its ``submitted`` event): a request it finds is joined, never
  submitted again, for as long as the log keeps events (``nats.events.max_age``,
  30 days by default). Left: a request published more than the window ago
  that no router has read yet (no ``submitted`` event) would be published a
  second time under the same id. A key is never taken for another body: its
  first call claims it before the publish (:func:`claim_key`, a compare-and-set
  entry holding the body's fingerprint, living two duplicate windows, pending
  until the stored request is known to have that body, then confirmed), and a
  call with another body meets the claim (422), unless the claim is pending and
  abandoned: unchanged for a grace with no request under the key on record, it
  is taken over by compare-and-set (``Submissions._take_over``: a key whose
  first call never stored its request may be used again, as Stripe's). Past
  the claim, the ``submitted`` event tells, and a request found stored while no
  claim of its body is confirmed is compared with that event, or a 409 rather
  than joined (see ``Submissions._same_body``); one with no body fingerprint
  on record (not published by a gateway) is compared by its content.
- **An SDK's own retry without a key.** The official SDKs resend the same
  body with ``x-stainless-retry-count`` above 0 and no idempotency key
  (the openai Python SDK sets none). Each gateway process remembers, for
  ``[gateway] retry_memory``, the fingerprint (tenant and body bytes) of the
  requests it submitted, and shares it with every other gateway process
  through the ``rq-state`` bucket (:func:`shared_key`, each entry living as
  long as the memory, by its ``Nats-TTL``); a retry whose fingerprint this
  process or the bucket remembers joins that request. First tries are never
  joined, however alike: only a retry says it repeats something. The shared
  entry is written in the background, so a retry that reaches another process
  within moments of the first try (before the write lands, typically a
  millisecond) is a new request; so is one that comes after the memory. Send
  ``Idempotency-Key`` where that matters.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

__all__ = ["RetryMemory", "claim_key", "fingerprint", "id_for_key", "shared_key"]

#: The longest idempotency key accepted (Stripe's limit).
MAX_KEY_LENGTH: Final = 255
#: Fingerprints a gateway process keeps at most (the oldest go first).
MAX_REMEMBERED: Final = 100_000


def id_for_key(key: str) -> str:
    """The request id an idempotency key names (the same in every process)."""
    return (
        "chatcmpl-idem-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:40]
    )


def fingerprint(tenant: str, body: bytes) -> str:
    """What identifies one body of one tenant (its retries resend it unchanged)."""
    return hashlib.sha256(tenant.encode() + b"\0" + body).hexdigest()


def claim_key(tenant: str, request_id: str) -> str:
    """Where the claim of an idempotency key's request (its body's fingerprint)
    is kept in the ``rq-state`` bucket."""
    return f"gw.{tenant}.key.{request_id}"


def shared_key(tenant: str, print_: str) -> str:
    """Where a fingerprint's request id is shared in the ``rq-state`` bucket."""
    return f"gw.{tenant}.{print_[:48]}"


class RetryMemory:
    """Fingerprint -> request id, for ``ttl`` seconds, at most ``size`` entries."""

    def __init__(
        self,
        ttl: float,
        *,
        size: int = MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ttl
        self._size = size
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def ttl(self) -> float:
        """Seconds a fingerprint is remembered."""
        return self._ttl

    def remember(self, print_: str, request_id: str) -> None:
        self._entries[print_] = (self._clock() + self._ttl, request_id)
        self._entries.move_to_end(print_)
        self._forget()

    def forget(self, print_: str) -> None:
        self._entries.pop(print_, None)

    def recall(self, print_: str) -> str | None:
        self._forget()
        entry = self._entries.get(print_)
        return None if entry is None else entry[1]

    def _forget(self) -> None:
        now = self._clock()
        while self._entries:
            key, (until, _rid) = next(iter(self._entries.items()))
            if until > now and len(self._entries) <= self._size:
                return
            del self._entries[key]
