"""Leases: at most one holder of a role at a time, judged by the server's clock.

A lease is one key in the ``rq-leases`` KV bucket, whose entries expire
``router.lease_ttl`` after they were last written (the bucket's ``max_age``:
the server removes the entry, no client clock involved). The holder creates
the key (a create fails while another holder's entry lives), then renews it
with compare-and-set on the revision it last wrote, every ``ttl / 5``. A
holder that dies stops renewing; its entry expires and a waiting candidate's
create succeeds.

The holder acts only while :meth:`Lease.valid`: within ``ttl`` of *sending*
its last successful write, less a margin. The server stored that write no
earlier than it was sent and expires it ``ttl`` after storing it, so while a
holder's lease is valid no other candidate can have acquired it (clocks run
at the same rate; nothing compares their readings). What this does not stop:
a holder paused *between* its validity check and the act it guards (a
``SIGSTOP``, a swapped-out process) acts once more after it resumed. The
checks sit right before each act, and what the binder guards is bounded by
the broker anyway (a backend consumer's ``max_ack_pending``).

The entry's value names its holder and, from the first renewal on, its term
(``<holder>\n<term>``): the revision of the create that began the term,
which renewals move on. So anyone can tell who holds the lease and since which
term (:func:`read_lease`): the create's own entry has its term as its revision.

A renewal that fails because the key moved on (another holder, or the entry
expired: compare-and-set on a stale revision) ends the lease: :meth:`renew`
returns False and the holder must stop. A renewal that fails for any other
reason (a timeout, a reconnect) raises; the lease is still held, and still
valid for what is left of its ttl, so the caller retries.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Final

from msgspec import Struct

from ..broker import JetStream, KeyEntry, KeyValue
from ..errors import NatsNotFoundError, WrongLastSequenceError
from ..schema import LEASE_BUCKET

__all__ = ["LEASE_MARGIN", "Lease", "LeaseHolder", "read_lease"]

#: The share of the ttl a holder gives up, for the time between its validity
#: check and the act it guards, and for the server's write being stored late.
LEASE_MARGIN: Final = 0.25


class LeaseHolder(Struct, frozen=True, kw_only=True):
    """Who holds a lease now, and since which term (the revision its create was stored at)."""

    holder: str
    term: int


def _value(holder: str, term: int | None) -> bytes:
    return holder.encode() if term is None else f"{holder}\n{term}".encode()


def holder_of(entry: KeyEntry) -> LeaseHolder:
    """The holder and term a lease's entry names. Pure.

    A value with no term is the create's (or an older version's renewal): its
    revision is the term.
    """
    text = entry.value.decode(errors="replace")
    holder, _, term = text.rpartition("\n")
    if holder and term.isdigit():
        return LeaseHolder(holder=holder, term=int(term))
    return LeaseHolder(holder=text, term=entry.revision)


async def read_lease(js: JetStream, key: str) -> LeaseHolder | None:
    """Who holds the lease ``key`` now (``None``: no one: it expired or was given up)."""
    try:
        entry = await (await js.key_value(LEASE_BUCKET)).get(key)
    except NatsNotFoundError:
        return None
    return holder_of(entry)


class Lease:
    """One role's lease (``key``) held or sought by ``holder``.

    ``holder`` names this process and instance uniquely: an entry holding it
    after a restart of the supervising loop is still this holder's own.
    """

    def __init__(
        self,
        js: JetStream,
        key: str,
        holder: str,
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._js = js
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self._clock = clock
        self._kv: KeyValue | None = None
        self._revision: int | None = None
        self._term: int | None = None
        self._valid_until = -math.inf  # ``clock`` time; never held
        #: Set by every successful write: wakes :meth:`until_valid`.
        self._renewed = asyncio.Event()

    @property
    def term(self) -> int | None:
        """The revision this holder acquired the lease at (None when not held).

        It grows with every acquisition by anyone, so it names a term of office.
        """
        return self._term if self._revision is not None else None

    @property
    def held(self) -> bool:
        """Whether this holder believes it holds the lease (it may no longer be valid)."""
        return self._revision is not None

    def valid(self) -> bool:
        """True while no other candidate can have acquired the lease."""
        return self._revision is not None and self._clock() < self._valid_until

    async def until_valid(self) -> None:
        """Return once :meth:`valid` (at once if it is)."""
        while not self.valid():
            self._renewed.clear()
            await self._renewed.wait()

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._js.key_value(LEASE_BUCKET)
        return self._kv

    async def try_acquire(self) -> bool:
        """Take the lease if no one holds it (or this holder already does)."""
        kv = await self._bucket()
        sent = self._clock()
        try:
            revision = await kv.create(self.key, self.holder.encode())
        except NatsNotFoundError:
            # The create found the key taken, and nats-py's look at it found
            # it gone: it expired in between. The next attempt creates it.
            return False
        except WrongLastSequenceError:
            return await self._adopt(kv)
        self._granted(revision, sent, new_term=True)
        return True

    async def _adopt(self, kv: KeyValue) -> bool:
        """The key exists: it is ours if it holds our name (a restarted loop)."""
        try:
            entry = await kv.get(self.key)
        except NatsNotFoundError:
            return False  # expired in between: the next attempt creates it
        owner = holder_of(entry)
        if owner.holder != self.holder:
            return False
        self._revision = entry.revision
        if self._term is None:
            self._term = owner.term
        return await self.renew()

    async def renew(self) -> bool:
        """Extend the lease. False if it was lost (the key moved on); raises if unsure."""
        if self._revision is None:
            return False
        kv = await self._bucket()
        sent = self._clock()
        try:
            revision = await kv.update(
                self.key, _value(self.holder, self._term), last=self._revision
            )
        except WrongLastSequenceError:
            self._lost()
            return False
        self._granted(revision, sent, new_term=False)
        return True

    async def release(self) -> None:
        """Give the lease up now, so a waiting candidate takes over without waiting out the ttl."""
        revision = self._revision
        self._lost()
        if revision is None:
            return
        kv = await self._bucket()
        try:
            await kv.delete(self.key, last=revision)
        except NatsNotFoundError:
            pass  # expired: nothing to give up
        except WrongLastSequenceError:
            pass  # already someone else's

    def _granted(self, revision: int, sent: float, *, new_term: bool) -> None:
        if new_term:
            self._term = revision
        self._revision = revision
        self._valid_until = sent + self.ttl * (1.0 - LEASE_MARGIN)
        self._renewed.set()

    def _lost(self) -> None:
        self._revision = None
        self._term = None
        self._valid_until = -math.inf
