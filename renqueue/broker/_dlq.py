"""The dead-letter stream as a tool: list, show, requeue and purge what is in ``RQ_DLQ``.

What lands there (each a copy of the message as it was, with why)::

    rq.dlq.requests   a request the router rejected (malformed, poison, unknown
                      route, ...) or could not hand to a backend (undeliverable),
                      or whose message ran out of deliveries (the advisories)
    rq.dlq.dispatch   a request that failed for good on its backend (its retry
                      budget used up, a 400, ...), an undecodable dispatch
                      (poison), or a dispatch that ran out of deliveries

Headers: ``Rq-Tenant``, ``Rq-Request-Id``, ``Rq-Reason`` (``<error_type>: <text>``),
``Rq-Source-Subject``, ``Nats-Msg-Id``. An entry is addressed by its stream
sequence; its time is when the stream stored it (the server's clock). The
request's full history is its events in ``RQ_EVENTS``
(:meth:`~renqueue.broker.EventLog.history`).

Requeue. A request ends exactly once (its terminal claim), so a dead-lettered
request never runs again under its own id: :meth:`DeadLetters.requeue`
submits a *new* request, the same one with

- a deterministic id, :func:`requeue_id`: ``<id>-dlq<seq>`` (hashed to fit the
  128-character id pattern), so a new attempt budget, and a requeue of the same
  entry always names the same request;
- the fields only services set reset (``requeues`` to 0, ``fallback`` to none:
  admission refuses them on the client subject), published on the client
  subject ``rq.req.<priority>.<tenant>`` with ``Nats-Msg-Id: <tenant>:<new id>``,
  as a client submits;
- a fresh deadline: the original's budget (its deadline minus when it was
  submitted, by its ``submitted`` event) counted from now, or a budget given
  (``deadline=``), or none;
- ``metadata`` linking back: ``requeued_from`` (the original id) and
  ``dlq_seq``.

It is idempotent however far apart the calls: after publishing, a marker is
stored in the dead-letter stream itself, on ``rq.dlq.requeued.<seq>``, with
``Nats-Expected-Last-Subject-Sequence: 0`` (stored once, however many
requeues race); a requeue that finds the marker, or finds that the new id
already has a ``submitted`` event (a requeue that died before its marker),
publishes nothing. Requeues within the requests' duplicate window are
deduplicated by the message id as well. ``list`` and ``show`` read the marker
to say that, and as which id, an entry was requeued. The one gap: a requeue
that died between its publish and its marker, and another past the duplicate
window while no router has read the first copy yet, stores the request twice
(its terminal claim still keeps one outcome, and a worker that finds it ended
does not call the backend).

Refused, entry by entry (:class:`DeadLetterError`, the others go on): a
payload that is not a request (poison), a payload whose tenant is not the
entry's, a request whose log says it completed or was cancelled (its dead
letter was written by a run that lost the race to end it), and, given a
config, a request it would reject (unknown route, ...).

Purge deletes entries (and their requeue markers) by sequence. Entries expire
with the stream's ``max_age`` (``nats.dlq.max_age``, 30 days) anyway.

Nothing here trusts an entry: header values are decoded whatever their bytes
(non-UTF-8 is replaced), capped, and escaped when rendered
(:func:`printable`); a payload that does not decode is shown as escaped bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import email.header
import hashlib
import math
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Final

import msgspec

from ..config import Config
from ..errors import (
    InvalidRequestError,
    NatsError,
    NatsNoRespondersError,
    NatsNotFoundError,
    NatsTimeoutError,
    RenQueueError,
    WrongLastSequenceError,
)
from ..policy import validate
from ..schema import (
    DISPATCH_DECODER,
    DLQ_STREAM,
    REQUEST_DECODER,
    REQUESTS_STREAM,
    Cancelled,
    Completed,
    Dispatch,
    Event,
    InferenceRequest,
    Submitted,
    encode,
    kind_of,
    msg_id,
    request_subject,
)
from ..text import clock, printable, shorten
from ._eventlog import EventLog, submitted_of
from ._nats import AckPolicy, ConsumerConfig, DeliverPolicy, JetStream, PubAck, StoredMessage

__all__ = [
    "DeadLetter",
    "DeadLetterError",
    "DeadLetterFilter",
    "DeadLetters",
    "Listing",
    "RequeueMark",
    "Requeued",
    "describe_event",
    "entry_fields",
    "entry_json",
    "printable",
    "render_entry",
    "render_listing",
    "requeue_id",
    "requeue_subject",
]

#: Entries are stored on ``rq.dlq.<stage>``, requeue markers on ``rq.dlq.requeued.<seq>``.
_ENTRIES: Final = "rq.dlq.*"
_MARKER: Final = "requeued"
_MARKERS: Final = f"rq.dlq.{_MARKER}.*"
#: Messages per fetch of a scan, and how long a fetch waits for them.
_BATCH: Final = 256
_FETCH_TIMEOUT: Final = 2.0
#: The latest start time a scan asks the server for (in the year 9999).
_LATEST: Final = 253_000_000_000.0
#: A scan's consumer left behind (its reader died) goes away this long after.
_CONSUMER_INACTIVE: Final = 10.0
_EXPECTED_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"
#: A header value kept is at most this long (the stream allows 64 KiB of headers).
_HEADER_CAP: Final = 2000
#: The longest request id (``InferenceRequest.id``).
_MAX_ID: Final = 128
#: ``metadata`` holds at most this many pairs (``InferenceRequest.metadata``).
_MAX_METADATA: Final = 64
_ID_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
#: How long a requeue whose publish was a duplicate waits for a router to log
#: the copy it was a duplicate of, when that copy was already read.
_DUPLICATE_CHECK: Final = 2.0


class DeadLetterError(RenQueueError):
    """One entry cannot be shown, requeued or purged; ``seq`` says which."""

    def __init__(self, message: str, *, seq: int) -> None:
        super().__init__(message)
        self.seq = seq


class DeadLetterFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which entries: every field given must match (``None``: any).

    ``reason``: a prefix of ``Rq-Reason`` (its error type first), any case;
    ``since``/``until``: Unix times, against when the stream stored the entry
    (``until`` exclusive).
    """

    tenant: str | None = None
    reason: str | None = None
    stage: str | None = None
    since: float | None = None
    until: float | None = None
    request_id: str | None = None

    @property
    def empty(self) -> bool:
        return self == DeadLetterFilter()


class RequeueMark(msgspec.Struct, frozen=True, kw_only=True):
    """What ``rq.dlq.requeued.<seq>`` holds: entry ``dlq_seq`` was requeued as ``new_id``."""

    v: int = 1
    dlq_seq: int
    tenant: str
    request_id: str
    new_id: str
    #: The new request's deadline (Unix seconds), if it has one.
    deadline: float | None = None
    #: When the requeue published it (the requeuing host's clock).
    at: float = 0.0


_MARK_DECODER: Final = msgspec.json.Decoder(RequeueMark)


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of ``RQ_DLQ``, as stored (headers decoded whatever their bytes)."""

    seq: int
    subject: str
    stage: str
    #: When the stream stored it (server time, Unix seconds); 0 if unknown.
    time: float
    tenant: str
    request_id: str
    reason: str
    source_subject: str
    headers: dict[str, str]
    payload: bytes
    #: Its requeue, if it was requeued.
    requeued: RequeueMark | None = None

    @property
    def error_type(self) -> str:
        """The reason's first word (``bad_request``, ``malformed``, ``undeliverable``)."""
        head, sep, _ = self.reason.partition(": ")
        return head if sep else self.reason

    def matches(self, where: DeadLetterFilter) -> bool:
        return (
            (where.tenant is None or self.tenant == where.tenant)
            and (where.stage is None or self.stage == where.stage)
            and (where.request_id is None or self.request_id == where.request_id)
            and (where.reason is None or self.reason.casefold().startswith(where.reason.casefold()))
            and (where.since is None or self.time >= where.since)
            and (where.until is None or self.time < where.until)
        )

    @property
    def original_size(self) -> int | None:
        """The size in bytes of the message this entry is an excerpt of (a
        message too big to copy whole); ``None`` for a whole copy."""
        size = self.headers.get("Rq-Original-Size", "")
        return int(size) if size.isascii() and size.isdigit() else None

    def decoded(self) -> InferenceRequest | Dispatch:
        """The payload as the stage's message; :class:`DeadLetterError` if it is
        not one (a poison message, or an excerpt of one too big to keep)."""
        if self.original_size is not None:
            raise DeadLetterError(
                f"the payload is an excerpt: the first {len(self.payload)} bytes of a "
                f"{self.original_size}-byte message, too big to keep whole",
                seq=self.seq,
            )
        decoder = DISPATCH_DECODER if self.stage == "dispatch" else REQUEST_DECODER
        try:
            return decoder.decode(self.payload)
        except msgspec.DecodeError as exc:
            what = "dispatch" if self.stage == "dispatch" else "request"
            raise DeadLetterError(
                f"the payload is not a {what} (a poison message): {_one_line(str(exc))}",
                seq=self.seq,
            ) from exc

    def request(self) -> InferenceRequest:
        decoded = self.decoded()
        return decoded.request if isinstance(decoded, Dispatch) else decoded

    def with_mark(self, mark: RequeueMark | None) -> DeadLetter:
        return msgspec.structs.replace(self, requeued=mark)


class Listing(msgspec.Struct, frozen=True, kw_only=True):
    """Entries that matched (the newest ``limit`` of them, oldest first)."""

    entries: list[DeadLetter]
    #: How many matched in all (more than ``len(entries)`` when a limit cut them).
    matched: int
    #: Entries read.
    scanned: int
    #: Entries that could not be read at all (skipped).
    unreadable: int = 0


class Requeued(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of requeuing one entry."""

    seq: int
    tenant: str
    request_id: str
    new_id: str
    deadline: float | None
    #: Nothing was published: it had been requeued before.
    already: bool


def _mark(
    seq: int, request: InferenceRequest, new_id: str, deadline: float | None, *, at: float
) -> RequeueMark:
    """The marker of entry ``seq``'s requeue of ``request`` as ``new_id``."""
    return RequeueMark(
        dlq_seq=seq,
        tenant=request.tenant,
        request_id=request.id,
        new_id=new_id,
        deadline=deadline,
        at=at,
    )


def _requeued(
    seq: int, request: InferenceRequest, new_id: str, deadline: float | None, *, already: bool
) -> Requeued:
    """The outcome of requeuing entry ``seq`` (``request``) as ``new_id``."""
    return Requeued(
        seq=seq,
        tenant=request.tenant,
        request_id=request.id,
        new_id=new_id,
        deadline=deadline,
        already=already,
    )


def requeue_id(request_id: str, seq: int) -> str:
    """The id a requeue of entry ``seq`` of request ``request_id`` gets:
    ``<id>-dlq<seq>``, or, when that is longer than 128 characters, the id cut
    short plus ``-dlq<seq>-`` and 16 hex digits of its SHA-256 (deterministic,
    and distinct for distinct original ids)."""
    plain = f"{request_id}-dlq{seq}"
    if len(plain) <= _MAX_ID:
        return plain
    tail = f"-dlq{seq}-{hashlib.sha256(request_id.encode()).hexdigest()[:16]}"
    return request_id[: _MAX_ID - len(tail)] + tail


def requeue_subject(seq: int) -> str:
    """Where the marker of entry ``seq``'s requeue is stored (in ``RQ_DLQ``)."""
    return f"rq.dlq.{_MARKER}.{seq}"


def _is_id(text: str) -> bool:
    return 0 < len(text) <= _MAX_ID and all(char in _ID_OK for char in text)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _header_text(value: object) -> str:
    """A header value as text, whatever its bytes: nats-py hands non-ASCII
    values over as ``email.header.Header`` objects of raw bytes; those are
    decoded as UTF-8, anything undecodable replaced."""
    if isinstance(value, email.header.Header):
        raw = b"".join(
            part if isinstance(part, bytes) else part.encode("utf-8", "surrogateescape")
            for part, _ in email.header.decode_header(value)
        )
        text = raw.decode("utf-8", "replace")
    else:
        text = str(value).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text if len(text) <= _HEADER_CAP else text[:_HEADER_CAP] + "..."


def _entry_of(stored: StoredMessage) -> DeadLetter | None:
    """The entry a stored message is, or ``None`` when it is not one (a marker)."""
    parts = stored.subject.split(".")
    if len(parts) != 3 or parts[:2] != ["rq", "dlq"]:
        return None
    headers = {_header_text(k): _header_text(v) for k, v in (stored.headers or {}).items()}
    return DeadLetter(
        seq=stored.seq,
        subject=stored.subject,
        stage=parts[2],
        time=stored.time.timestamp() if stored.time is not None else 0.0,
        tenant=headers.get("Rq-Tenant", "unknown"),
        request_id=headers.get("Rq-Request-Id", ""),
        reason=headers.get("Rq-Reason", ""),
        source_subject=headers.get("Rq-Source-Subject", ""),
        headers=headers,
        payload=stored.data or b"",
    )


def _mark_of(stored: StoredMessage) -> tuple[int, RequeueMark] | None:
    """``(entry seq, mark)`` for a marker message; ``None`` for anything else."""
    parts = stored.subject.split(".")
    if len(parts) != 4 or parts[:3] != ["rq", "dlq", _MARKER] or not parts[3].isdigit():
        return None
    try:
        mark = _MARK_DECODER.decode(stored.data or b"")
    except msgspec.DecodeError:
        return None
    seq = int(parts[3])
    return (seq, mark) if mark.dlq_seq == seq else None


def _scan_consumer(subject: str, since: float | None) -> ConsumerConfig:
    """An ephemeral, unacknowledged consumer of ``subject`` from time ``since`` on."""
    if since is not None and not 0 < since < _LATEST:
        since = None if since <= 0 or math.isnan(since) else _LATEST
    return ConsumerConfig(
        filter_subject=subject,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
        # A millisecond early: a float time is coarser than the stored
        # nanoseconds, and the filter (DeadLetter.matches) is exact anyway.
        opt_start_time=None
        if since is None
        else datetime.datetime.fromtimestamp(since - 0.001, tz=datetime.UTC),
        inactive_threshold=_CONSUMER_INACTIVE,
        mem_storage=True,
        num_replicas=1,
    )


def _admissible(
    request: InferenceRequest, config: Config, message_id: str, seq: int, *, now: float
) -> None:
    """Refuse (:class:`DeadLetterError`) what admission would reject under ``config``."""
    if request.priority not in config.priorities:
        raise DeadLetterError(
            f"admission would reject it: no priority level {request.priority!r} in the config: "
            "not requeued",
            seq=seq,
        )
    try:
        validate(
            request,
            level=request.priority,
            tenant=request.tenant,
            config=config,
            message_id=message_id,
            now=now,
        )
    except InvalidRequestError as exc:
        raise DeadLetterError(f"admission would reject it: {exc}: not requeued", seq=seq) from exc


class _Scan:
    """What a read of the stream met that it could not use."""

    __slots__ = ("unreadable",)

    def __init__(self) -> None:
        self.unreadable = 0


class DeadLetters:
    """List, show, requeue and purge entries of ``RQ_DLQ`` (see the module docstring)."""

    def __init__(self, js: JetStream, *, clock: float | None = None) -> None:
        self._js = js
        self._log = EventLog(js)
        #: A fixed "now" for tests; ``None``: the wall clock.
        self._clock = clock

    def _now(self) -> float:
        return time.time() if self._clock is None else self._clock

    # ------------------------------------------------------------------ reading

    async def _last_seq(self) -> int:
        try:
            return (await self._js.stream_info(DLQ_STREAM)).state.last_seq
        except NatsNotFoundError as exc:
            raise NatsNotFoundError(f"no dead-letter stream {DLQ_STREAM} ({exc})") from exc

    async def _stored(
        self, subject: str, last: int, scan: _Scan, *, since: float | None = None
    ) -> AsyncGenerator[StoredMessage, None]:
        """Messages stored on ``subject`` up to sequence ``last`` (from time
        ``since``, if given), in stream order.

        Read in batches through an ephemeral, unacknowledged pull consumer.
        Whatever that leaves unread (a delivery lost) is read one message per
        get, and a message nats-py cannot parse even then is skipped and
        counted (``scan.unreadable``) instead of ending the scan.
        """
        config = _scan_consumer(subject, since)
        seq = 1
        psub = await self._js.pull_subscribe(subject, stream=DLQ_STREAM, config=config)
        try:
            pending = (await psub.consumer_info()).num_pending or 0
            while pending > 0:
                try:
                    msgs = await psub.fetch(batch=_BATCH, timeout=_FETCH_TIMEOUT)
                except NatsTimeoutError:
                    break  # some went missing: read one by one below
                for msg in msgs:
                    meta = msg.metadata
                    if meta.sequence.stream > last:
                        return
                    seq = meta.sequence.stream + 1
                    pending = meta.num_pending
                    yield StoredMessage(
                        meta.sequence.stream, msg.subject, msg.data, msg.headers, meta.timestamp
                    )
            if pending <= 0:
                return
        finally:
            name = psub.consumer
            with contextlib.suppress(NatsError):
                await psub.unsubscribe()
            with contextlib.suppress(NatsError, TimeoutError):
                await asyncio.wait_for(self._js.delete_consumer(DLQ_STREAM, name), 2.0)
        while seq <= last:
            try:
                stored = await self._js.get_msg(DLQ_STREAM, seq=seq, subject=subject, next=True)
            except NatsNotFoundError:
                return
            except NatsError:
                raise
            except Exception:  # noqa: BLE001 - nats-py choked on the next message stored
                # It is the first at or after seq: step over the gap to it, one by one.
                if await self._unreadable(seq):
                    scan.unreadable += 1
                seq += 1
                continue
            if stored.seq > last:
                return
            seq = stored.seq + 1
            yield stored

    async def _unreadable(self, seq: int) -> bool:
        """Whether message ``seq`` is stored but cannot be read."""
        try:
            await self._js.get_msg(DLQ_STREAM, seq=seq)
        except NatsNotFoundError:
            return False
        except NatsError:
            raise
        except Exception:  # noqa: BLE001 - nats-py could not parse it
            return True
        return False

    async def marks(self) -> dict[int, RequeueMark]:
        """Every requeue marker, by the sequence of its entry."""
        marks: dict[int, RequeueMark] = {}
        last = await self._last_seq()
        async with contextlib.aclosing(self._stored(_MARKERS, last, _Scan())) as stored_msgs:
            async for stored in stored_msgs:
                if (marked := _mark_of(stored)) is not None:
                    marks.setdefault(*marked)
        return marks

    async def find(self, where: DeadLetterFilter, *, limit: int | None = None) -> Listing:
        """The entries that match ``where``: the newest ``limit`` (oldest first)."""
        marks = await self.marks()
        last = await self._last_seq()
        scan = _Scan()
        kept: collections.deque[DeadLetter] = collections.deque(maxlen=limit)
        matched = scanned = 0
        reading = self._stored(_ENTRIES, last, scan, since=where.since)
        async with contextlib.aclosing(reading) as stored_msgs:
            async for stored in stored_msgs:
                entry = _entry_of(stored)
                if entry is None:
                    continue
                scanned += 1
                if entry.matches(where):
                    matched += 1
                    kept.append(entry.with_mark(marks.get(entry.seq)))
        return Listing(
            entries=list(kept), matched=matched, scanned=scanned, unreadable=scan.unreadable
        )

    async def get(self, seq: int) -> DeadLetter:
        """Entry ``seq``, with its requeue; :class:`DeadLetterError` if there is none."""
        try:
            stored = await self._js.get_msg(DLQ_STREAM, seq=seq)
        except NatsNotFoundError as exc:
            await self._last_seq()  # no stream at all: that error instead
            raise DeadLetterError(f"no dead letter {seq}", seq=seq) from exc
        except NatsError:
            raise
        except Exception as exc:
            raise DeadLetterError(
                f"dead letter {seq} cannot be read: {type(exc).__name__}", seq=seq
            ) from exc
        entry = _entry_of(stored)
        if entry is None:
            raise DeadLetterError(f"no dead letter {seq} (message {seq} is a marker)", seq=seq)
        return entry.with_mark(await self.mark(seq))

    async def mark(self, seq: int) -> RequeueMark | None:
        """The marker of entry ``seq``'s requeue, if it was requeued."""
        try:
            stored = await self._js.get_last_msg(DLQ_STREAM, requeue_subject(seq))
        except NatsNotFoundError:
            return None
        marked = _mark_of(stored)
        return None if marked is None else marked[1]

    async def history(self, entry: DeadLetter) -> list[Event]:
        """The request's events, in log order (none for an entry that names no
        valid tenant and id: a poison message's)."""
        if not (_is_id(entry.tenant) and _is_id(entry.request_id)):
            return []
        return await self._log.history(entry.tenant, entry.request_id)

    async def requeued_as(self, entry: DeadLetter) -> RequeueMark | None:
        """Its marker, or, for a requeue that died before writing one, what the
        new request's ``submitted`` event says (``None``: not requeued)."""
        if entry.requeued is not None:
            return entry.requeued
        try:
            request = entry.request()
        except DeadLetterError:
            return None
        if not _is_id(request.tenant):
            return None
        new_id = requeue_id(request.id, entry.seq)
        submitted = await self._submitted(request.tenant, new_id)
        if submitted is None:
            return None
        return RequeueMark(
            dlq_seq=entry.seq,
            tenant=request.tenant,
            request_id=request.id,
            new_id=new_id,
            deadline=submitted.request.deadline,
            at=submitted.at,
        )

    async def _submitted(self, tenant: str, request_id: str) -> Submitted | None:
        """The requeued request's first ``submitted`` event, as its history starts."""
        return await submitted_of(self._js, tenant, request_id, first=True)

    # ------------------------------------------------------------------ requeue

    async def requeue(
        self,
        entry: DeadLetter,
        *,
        budget: float | None = None,
        keep_budget: bool = True,
        config: Config | None = None,
    ) -> Requeued:
        """Submit entry's request again as a new request (see the module docstring).

        ``keep_budget``: the new deadline is now plus the original's budget;
        otherwise now plus ``budget`` seconds (``None``: no deadline).
        ``config``: check the new request as admission will (routes, levels).
        Raises :class:`DeadLetterError` when the entry cannot be requeued.
        """
        seq = entry.seq
        request = entry.request()
        tenant = request.tenant
        if tenant != entry.tenant:
            raise DeadLetterError(
                f"the payload names tenant {tenant!r}, the entry tenant {entry.tenant!r}: "
                "not requeued",
                seq=seq,
            )
        new_id = requeue_id(request.id, seq)
        done = entry.requeued or await self.mark(seq)
        if done is not None:
            return _requeued(seq, request, done.new_id, done.deadline, already=True)
        history = await self._log.history(tenant, request.id)
        for event in history:
            if isinstance(event, Completed | Cancelled):
                raise DeadLetterError(
                    f"request {request.id} {kind_of(event)} (its dead letter is from a run "
                    "that lost the race to end it): not requeued",
                    seq=seq,
                )
        logged = await self._submitted(tenant, new_id)
        if logged is not None:  # requeued by a run that died before its marker
            mark = await self._store_mark(
                _mark(seq, request, new_id, logged.request.deadline, at=logged.at)
            )
            return _requeued(seq, request, new_id, mark.deadline, already=True)
        again = self._again(entry, request, new_id, history, budget, keep_budget=keep_budget)
        header = msg_id(tenant, new_id)
        if config is not None:
            _admissible(again, config, header, seq, now=self._now())
        duplicate = await self._publish_again(again, header, seq, new_id)
        mark = await self._store_mark(_mark(seq, request, new_id, again.deadline, at=self._now()))
        return _requeued(seq, request, new_id, mark.deadline, already=duplicate)

    async def _publish_again(
        self, again: InferenceRequest, header: str, seq: int, new_id: str
    ) -> bool:
        """Publish the new request (message id ``header``); whether it was a
        duplicate (a requeue of the same entry already stored it)."""
        tenant = again.tenant
        subject = request_subject(again.priority, tenant)
        try:
            ack = await self._js.publish(subject, encode(again), headers={"Nats-Msg-Id": header})
        except NatsNoRespondersError as exc:
            raise DeadLetterError(
                f"no stream takes priority {again.priority!r} (no level of that name): "
                "not requeued",
                seq=seq,
            ) from exc
        if ack.duplicate:
            await self._check_duplicate(seq, ack, subject=subject, tenant=tenant, new_id=new_id)
        return bool(ack.duplicate)

    def _again(
        self,
        entry: DeadLetter,
        request: InferenceRequest,
        new_id: str,
        history: list[Event],
        budget: float | None,
        *,
        keep_budget: bool,
    ) -> InferenceRequest:
        """The new request: ``request`` under ``new_id``, services' fields reset,
        a fresh deadline, linked back in its metadata."""
        now = self._now()
        if keep_budget:
            deadline = None
            if request.deadline is not None:
                submitted = next((e.at for e in history if isinstance(e, Submitted)), None)
                if submitted is None:
                    submitted = request.submitted_at or entry.time
                deadline = now + max(0.0, request.deadline - submitted)
        else:
            deadline = None if budget is None else now + budget
        metadata = {**request.metadata, "requeued_from": request.id, "dlq_seq": str(entry.seq)}
        if len(metadata) > _MAX_METADATA:
            raise DeadLetterError(
                f"its metadata has {len(request.metadata)} pairs: no room for requeued_from "
                f"and dlq_seq (at most {_MAX_METADATA}): not requeued",
                seq=entry.seq,
            )
        if deadline is not None and not math.isfinite(deadline):
            deadline = None
        return msgspec.structs.replace(
            request,
            id=new_id,
            requeues=0,
            fallback=None,
            deadline=deadline,
            submitted_at=now,
            metadata=metadata,
        )

    async def _check_duplicate(
        self, seq: int, ack: PubAck, *, subject: str, tenant: str, new_id: str
    ) -> None:
        """A duplicate publish is ours only if the copy it names is ours: still
        waiting on our subject, or read and logged under the new id. Anyone
        may publish a message id on their own subject first."""
        if ack.stream == REQUESTS_STREAM and ack.seq:
            try:
                stored = await self._js.get_msg(REQUESTS_STREAM, seq=ack.seq)
            except NatsNotFoundError:
                pass
            else:
                if stored.subject == subject:
                    return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _DUPLICATE_CHECK
        while True:
            if await self._submitted(tenant, new_id) is not None:
                return
            if loop.time() >= give_up:
                raise DeadLetterError(
                    f"its message id {msg_id(tenant, new_id)!r} was taken by another "
                    "publish and no request of that id is logged: not requeued",
                    seq=seq,
                )
            await asyncio.sleep(0.1)  # a router that read our copy logs it at once

    async def _store_mark(self, mark: RequeueMark) -> RequeueMark:
        """Store ``mark`` unless a marker is stored already; the stored one."""
        try:
            await self._js.publish(
                requeue_subject(mark.dlq_seq),
                encode(mark),
                headers={_EXPECTED_LAST_SUBJECT_SEQ: "0"},
            )
        except WrongLastSequenceError:
            return await self.mark(mark.dlq_seq) or mark
        return mark

    # -------------------------------------------------------------------- purge

    async def purge(self, entry: DeadLetter) -> None:
        """Delete ``entry`` (as read by :meth:`find` or :meth:`get`) and, if it
        was requeued, its marker; :class:`DeadLetterError` if it is gone."""
        seq = entry.seq
        try:
            await self._js.delete_msg(DLQ_STREAM, seq)
        except NatsNotFoundError as exc:
            raise DeadLetterError(f"no dead letter {seq} (purged meanwhile)", seq=seq) from exc
        if entry.requeued is None:
            return  # a marker stored since is left (it names a sequence never used again)
        with contextlib.suppress(NatsNotFoundError):
            marker = await self._js.get_last_msg(DLQ_STREAM, requeue_subject(seq))
            await self._js.delete_msg(DLQ_STREAM, marker.seq)


# -------------------------------------------------------------------- rendering


def describe_event(event: Event) -> str:
    """One line for an event of a request's history (escaped)."""
    data = msgspec.to_builtins(event)
    for key in ("kind", "v", "request_id", "tenant", "at"):
        data.pop(key, None)
    if isinstance(event, Submitted):
        request = event.request
        data = {
            "route": request.route,
            "priority": request.priority,
            "messages": len(request.messages),
            "deadline": clock(request.deadline) if request.deadline is not None else None,
        }
    if isinstance(event, Completed):
        text = event.text
        data["text"] = text if len(text) <= 60 else text[:57] + "..."
    details = " ".join(f"{k}={v}" for k, v in data.items() if v not in (None, "", [], ()))
    return printable(f"{kind_of(event):<16} {details}")


def payload_preview(payload: bytes, limit: int = 200) -> str:
    """The first ``limit`` bytes as escaped text (``repr``-like, no quotes)."""
    text = payload[:limit].decode("utf-8", "backslashreplace")
    return printable(text) + ("..." if len(payload) > limit else "")


def _describe_payload(entry: DeadLetter) -> str:
    try:
        decoded = entry.decoded()
    except DeadLetterError as exc:
        return f"{exc} ({len(entry.payload)} bytes: {payload_preview(entry.payload)})"
    if isinstance(decoded, Dispatch):
        head = f"dispatch to {decoded.backend}, attempt {decoded.attempt}; "
        request = decoded.request
    else:
        head, request = "", decoded
    deadline = "none" if request.deadline is None else clock(request.deadline)
    return printable(
        f"{head}request {request.id} of {request.tenant}: route={request.route} "
        f"priority={request.priority} messages={len(request.messages)} deadline={deadline} "
        f"({len(entry.payload)} bytes)"
    )


def _requeued_text(entry: DeadLetter) -> str:
    mark = entry.requeued
    if mark is None:
        return f"no (renqueue dlq requeue {entry.seq})"
    deadline = "no deadline" if mark.deadline is None else f"deadline {clock(mark.deadline)}"
    return printable(f"as {mark.new_id} at {clock(mark.at)} ({deadline})")


def entry_fields(entry: DeadLetter) -> list[tuple[str, str]]:
    """An entry's fields for a person, escaped, in the order ``show`` gives them."""
    return [
        ("tenant", printable(entry.tenant)),
        ("request", printable(entry.request_id)),
        ("reason", printable(entry.reason)),
        ("from", printable(entry.source_subject)),
        ("requeued", _requeued_text(entry)),
        ("payload", _describe_payload(entry)),
    ]


def render_entry(entry: DeadLetter, history: Sequence[Event]) -> list[str]:
    """``show``: one entry, its reason, headers and payload, and the request's history."""
    lines = [
        f"dead letter {entry.seq} on {printable(entry.subject)}, stored {clock(entry.time)}",
        *(f"  {key:<10} {value}" for key, value in entry_fields(entry)),
        "  headers",
    ]
    lines += [f"    {printable(k)}: {printable(v)}" for k, v in sorted(entry.headers.items())]
    if not history:
        lines.append("history: no events logged for this request")
        return lines
    lines.append(f"history ({len(history)} events):")
    lines += [
        f"  {clock(event.at) if math.isfinite(event.at) else '-'}  {describe_event(event)}"
        for event in history
    ]
    return lines


def render_listing(listing: Listing) -> list[str]:
    """``list``: one line per entry, then a count."""
    rows = [
        (
            str(e.seq),
            clock(e.time),
            printable(shorten(e.stage, 10)),
            printable(shorten(e.tenant, 64)),
            printable(shorten(e.request_id, _MAX_ID)),
            "-" if e.requeued is None else printable(shorten(e.requeued.new_id, _MAX_ID)),
            printable(shorten(" ".join(e.reason.split()), 100)),
        )
        for e in listing.entries
    ]
    header = ("seq", "stored (UTC)", "stage", "tenant", "request", "requeued as", "reason")
    widths = [max([len(header[i])] + [len(row[i]) for row in rows]) for i in range(6)]
    lines = [
        "  ".join(
            [cells[0].rjust(widths[0])]
            + [cell.ljust(width) for cell, width in zip(cells[1:6], widths[1:], strict=True)]
            + [cells[6]]
        ).rstrip()
        for cells in [header, *rows]
    ]
    shown = len(listing.entries)
    summary = f"{listing.matched} of {listing.scanned} dead letters match"
    if shown < listing.matched:
        summary += f"; the newest {shown} shown (--limit)"
    if listing.unreadable:
        summary += f"; {listing.unreadable} unreadable, skipped"
    return [*lines, summary] if rows else [summary]


def entry_json(entry: DeadLetter, history: Sequence[Event] | None = None) -> dict[str, object]:
    """An entry as JSON-ready builtins: the payload decoded when it decodes, else
    its text (undecodable bytes escaped) and why not."""
    out: dict[str, object] = {
        "seq": entry.seq,
        "subject": entry.subject,
        "stage": entry.stage,
        "time": entry.time,
        "tenant": entry.tenant,
        "request_id": entry.request_id,
        "error_type": entry.error_type,
        "reason": entry.reason,
        "source_subject": entry.source_subject,
        "requeued": None if entry.requeued is None else msgspec.to_builtins(entry.requeued),
        "headers": entry.headers,
        "payload_size": len(entry.payload),
    }
    try:
        out["payload"] = msgspec.to_builtins(entry.decoded())
    except DeadLetterError as exc:
        out["payload"] = None
        out["payload_error"] = str(exc)
        out["payload_text"] = entry.payload[:4096].decode("utf-8", "backslashreplace")
    if history is not None:
        out["history"] = [msgspec.to_builtins(event) for event in history]
    return out
