"""A request's token stream, followed live and read back from the store.

:class:`TokenFollower` hands out every chunk of one request, in order, once
(its docstring says how); :meth:`RequestHandle.stream
<renqueue.client.RequestHandle.stream>` iterates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Final

import msgspec

from ..broker import EventLog, Message, Subscription, read_subject
from ..errors import NatsError, TokensExpiredError
from ..logs import misdirected
from ..schema import TOKEN_DECODER, TOKENS_STREAM, TokenChunk, kind_of, token_subject
from ._retries import TRANSIENT, retrying

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["LIVE_CHUNKS", "TokenFollower"]

#: Live chunks a token follower holds for a reader that is not reading.
LIVE_CHUNKS: Final = 4096


class TokenFollower:
    """Every chunk of one request, in order, once: stored ones, then live ones.

    A core subscription to the token subject collects live chunks from the
    start. Stored chunks are read back only when there are any: a
    ``last_by_subj`` direct get says so, and only then a short-lived consumer
    filtered to this one subject replays them (:func:`read_subject`). In the
    common case (following from the submit) nothing is stored yet and no
    JetStream consumer is made: they are server-side objects, costly to create
    at hundreds of streams a second.

    Chunks are handed out by run (``delivery``) and ``seq``. A live chunk
    that skips ahead, a quiet spell of :attr:`IDLE` seconds and a reconnect
    all send the follower back to the store, so a stream ends whenever its
    final chunk is stored, even if its live copy was lost (a reconnect, a slow
    consumer), and a gap whose chunk was not yet committed (a cluster) is
    filled by a later read. A read that fails for a while (a timeout, no
    responders: the server restarting, a node down) is retried with a capped
    backoff, never raised. Once a newer run has begun (a ``restart`` chunk),
    chunks of older runs are void and dropped, late ones from a zombie run
    included.

    The final chunk carries its run and the run's next ``seq``: the stream
    ends once every chunk before it is handed out. A final chunk with
    ``seq`` 0 and text (a run whose whole answer came in its last read) ends
    it at once; one without (a run that streamed nothing, or one written
    before final chunks carried their position) after one more read of the store.

    Chunks are kept ``nats.tokens.max_age`` (1 h by default). A stream that
    cannot end from what is stored (its chunks aged out) would wait forever,
    so a quiet read of the store that finds nothing new looks the request's
    terminal event up: once the request has ended and one more read,
    :attr:`IDLE` seconds later, still finds nothing that ends the stream, it
    raises :class:`TokensExpiredError`; unless a run was handed out from its
    first chunk and only the final chunk is missing (the oldest chunks age
    out first, so that one is late, not gone: see :meth:`_check_expired`).
    """

    #: Seconds of silence after which the store is read again.
    IDLE = 2.0

    def __init__(self, client: Client, tenant: str, request_id: str) -> None:
        self._js = client.js
        self._nc = client.nc
        self._tenant = tenant
        self._request_id = request_id
        self._subject = token_subject(tenant, request_id)
        #: Live chunks not yet taken; bounded, so that a reader that stops
        #: reading holds at most this many (those past it are dropped, and read
        #: from the store when it reads on: a gap, or silence, sends it there).
        self._live: asyncio.Queue[TokenChunk] = asyncio.Queue(maxsize=LIVE_CHUNKS)
        #: Chunks received and not yet handed out, by (run, seq).
        self._pending: dict[tuple[int, int], TokenChunk] = {}
        self._final: TokenChunk | None = None
        self._run = 0  # the run being handed out (0: none yet)
        self._next = 0  # the next seq of that run
        self._cursor = 1  # next stream sequence to read from the store
        #: Whether the store was read after the final chunk was seen.
        self._read_after_final = False
        #: Whether the store was read since the last chunk was handed out.
        self._read_since_take = False
        self._reconnects = 0
        #: The newest run seen live, and in the store (in stream order): a
        #: chunk of an older run that comes after one of a newer run is from a
        #: zombie (a worker presumed dead), and void.
        self._newest_live = 0
        self._newest_stored = 0
        #: The kind of the request's terminal event, once a quiet read found it.
        self._outcome: str | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        # Subscribe before reading the store, so nothing falls between the two.
        self._reconnects = self._nc.reconnects
        self._sub = await self._nc.subscribe(self._subject, cb=self._on_live)
        await self._read_store()

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_live(self, msg: Message) -> None:
        # A tenant's push consumer can deliver its own stored messages here:
        # they keep the subject they were stored under. Only the services can
        # publish on this subject (or store on it), so it is the authority.
        if msg.subject != self._subject:
            misdirected("tokens", msg.subject)
            return
        with contextlib.suppress(msgspec.DecodeError):
            chunk = TOKEN_DECODER.decode(msg.data)
            if chunk.request_id == self._request_id:
                with contextlib.suppress(asyncio.QueueFull):
                    self._live.put_nowait(chunk)

    async def _read_store(self) -> None:
        """Read what the store has after the cursor; a transient failure (a
        reconnect, a stream leader election) is retried, never raised."""

        read = functools.partial(
            read_subject,
            self._nc,
            self._js,
            TOKENS_STREAM,
            self._subject,
            start=self._cursor,
            name=f"rq-tok-{self._tenant}",
        )
        stored = await retrying(
            self._nc, "reading stored tokens", read, request_id=self._request_id
        )
        for seq, data in stored:
            self._cursor = seq + 1
            with contextlib.suppress(msgspec.DecodeError):
                chunk = TOKEN_DECODER.decode(data)
                if chunk.final or chunk.delivery >= self._newest_stored:
                    self._newest_stored = max(self._newest_stored, chunk.delivery)
                    self._add(chunk)
        self._read_since_take = True
        if self._final is not None:
            self._read_after_final = True

    def _add(self, chunk: TokenChunk) -> None:
        if chunk.request_id != self._request_id:
            return
        if chunk.final:
            if self._final is None or chunk.delivery >= self._final.delivery:
                self._final = chunk
            return
        if chunk.delivery < self._run or (chunk.delivery == self._run and chunk.seq < self._next):
            return  # a void run (zombie), or handed out already
        self._pending[(chunk.delivery, chunk.seq)] = chunk

    def _add_live(self, chunk: TokenChunk) -> None:
        if chunk.final or chunk.delivery >= self._newest_live:
            self._newest_live = max(self._newest_live, chunk.delivery)
            self._add(chunk)

    def _take(self) -> TokenChunk | None:
        """The next chunk in order, if it is here."""
        chunk = self._pending.pop((self._run, self._next), None)
        if chunk is None:
            if not self._read_since_take:
                return None  # the store may still have this run's missing chunks
            # A newer run that has begun voids what is left of this one.
            newer = sorted(run for run, seq in self._pending if run > self._run and seq == 0)
            if not newer:
                return None
            self._run, self._next = newer[-1], 0
            self._pending = {k: v for k, v in self._pending.items() if k[0] >= self._run}
            chunk = self._pending.pop((self._run, 0))
        self._next = chunk.seq + 1
        self._read_since_take = False
        return chunk

    def _ended(self) -> TokenChunk | None:
        """The final chunk, once nothing before it is still to come."""
        final = self._final
        if final is None:
            return None
        if final.seq == 0 and final.delivery >= self._run and _carries(final):
            # A run's whole answer (its one read): nothing of its run before it,
            # and earlier runs are void.
            return final
        if final.seq > 0 and final.delivery >= self._run:
            if final.delivery == self._run and self._next >= final.seq:
                return final
            return None
        # seq 0 (the run streamed nothing), or a position that cannot be trusted
        # (a final chunk written before they carried their run's next seq).
        return final if self._read_after_final else None

    async def _check_expired(self) -> None:
        """After a quiet read that found nothing new: has the request ended?

        The first time it has, remember it (its final chunk may be being
        stored right now); the next time, the stored chunks cannot end the
        stream any more: they aged out of the store. Except when a run is
        being handed out from its first chunk and no final chunk is stored:
        chunks age out oldest first, so the final chunk was not written yet
        (its writer crashed after the terminal event; whoever settles the
        request's terminal claim writes it).
        """
        if self._outcome is not None:
            if self._run > 0 and self._final is None:
                return
            raise TokensExpiredError(request_id=self._request_id, outcome=self._outcome)
        try:
            event = await EventLog(self._js).terminal_of(self._tenant, self._request_id)
        except TRANSIENT:
            return  # looked up again after the next quiet read
        if event is not None:
            self._outcome = kind_of(event)

    async def next(self) -> TokenChunk:
        """The next chunk in order; the final chunk last."""
        while True:
            chunk = self._take()
            if chunk is not None:
                return chunk
            final = self._ended()
            if final is not None:
                return final
            if (self._pending or self._final is not None) and not self._read_since_take:
                # Something is here but not the next chunk: it was missed live.
                await self._read_store()
                continue
            try:
                live = await asyncio.wait_for(self._live.get(), self.IDLE)
            except TimeoutError:
                cursor = self._cursor
                await self._read_store()  # quiet: the store may have what was missed
                if self._cursor == cursor:
                    await self._check_expired()
                continue
            self._add_live(live)
            while not self._live.empty():
                self._add_live(self._live.get_nowait())
            reconnects = self._nc.reconnects
            if reconnects != self._reconnects:
                self._reconnects = reconnects
                await self._read_store()  # live chunks were lost while disconnected


def _carries(chunk: TokenChunk) -> bool:
    """Whether ``chunk`` has content (a final chunk with text was written by
    this version: its position is to be trusted)."""
    return bool(chunk.text or chunk.tool_calls or chunk.logprobs)
