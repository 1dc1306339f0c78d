"""What a chat call submits, and the retries that join it (the I/O around :mod:`._idempotency`).

:class:`Submissions` reads a chat body into a submission (:mod:`._openai`),
submits it through the tenant's :class:`~renqueue.Client`, or joins the
request a retry of it already made: by its ``Idempotency-Key`` (the id is
derived from it, and claimed for its body before the publish: a key sent
again with another body is refused), or,
for an SDK's own retry without a key, by the body's fingerprint, which this
process remembers and shares with every other gateway process through the
``rq-state`` bucket. It also cancels the request of a client that went
away, as a supervised job, unless another call of this process still
follows it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Final, NamedTuple

import msgspec

from ..broker import JetStream, KeyValue, PubAck, submitted_of
from ..client import Client, RequestHandle
from ..config import Config, parse_duration
from ..errors import (
    InvalidRequestError,
    NatsApiError,
    NatsNotFoundError,
    NatsPayloadTooLargeError,
    StoreFullError,
    UnknownPriorityError,
    WrongLastSequenceError,
)
from ..logs import get_logger
from ..schema import (
    CANCELS_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    STATE_BUCKET,
    CancelRequested,
    InferenceRequest,
    cancel_subject,
    event_subject,
)
from ..tasks import Supervisor
from . import _metrics as metrics
from ._errors import ApiError, from_error
from ._idempotency import MAX_KEY_LENGTH, RetryMemory, claim_key, shared_key
from ._openai import Submission, parse_chat, translate

__all__ = ["BODY_KEY", "DISCONNECTED", "ID_RE", "Submissions", "new_id", "no_model"]

log = get_logger("gateway")

#: Why a request is cancelled when its client goes away (a retry after it
#: submits anew rather than join a request cancelled under it).
DISCONNECTED: Final = "client disconnected"
#: The request metadata entry holding the body's fingerprint, for requests
#: with an idempotency key: a key sent again with another body is refused.
BODY_KEY: Final = "rq_body_sha256"
#: A request id as the gateway takes it from a path or the ``rq-state`` bucket (use
#: ``fullmatch``: an id is these characters and nothing after, not even a newline).
ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Requests this process submitted lately, by (tenant, id): their route, so
#: that they can be followed before a router has logged them.
_RECENT: Final = 10_000
#: Seconds a shared fingerprint's ack is waited for before its write is handed to
#: a supervised job (as long as nats-py waits for a JetStream publish's ack).
_SHARE_ACK_WAIT: Final = 5.0
_KEY_RE: Final = re.compile(rf"^[\x21-\x7e]{{1,{MAX_KEY_LENGTH}}}$")
#: How many duplicate windows a key's claim lives: past one window JetStream
#: forgets the publish's message id, but a publish is sent again for up to the
#: Client's ``submit_patience`` after the claim, and the server forgets ids on
#: a timer of the window's length (an id may outlive it by as much again).
_CLAIM_WINDOWS: Final = 2
#: What a claim's value starts with until the request under the key is known
#: to have the claimed body (then its value is the fingerprint alone).
_PENDING: Final = b"?"
#: What a pending claim made by a take-over (:meth:`Submissions._take_over`)
#: starts with: its call's publish may find another body's request stored (the
#: abandoned claim's call stored it and went away), so a call of its body that
#: finds a request stored never takes this claim, unsettled, for "its claimer
#: stored the request and went away" (:meth:`Submissions._claimer_gone`).
_TAKEN: Final = _PENDING + b"!"
#: A pending claim still unchanged this long after another call of its body
#: found the request stored was left by a call that went away (a live one
#: settles its claim within its ~3 s wait): the request is joined. Also how
#: long a pending claim of another body must stay unchanged, with no request
#: under the key on record, before a call takes it over (:meth:`Submissions._take_over`).
_CLAIMER_GONE_AFTER: Final = 5.0


class _Claim(NamedTuple):
    """A key's claim as a keyed submit made or found it (:meth:`Submissions._claim`)."""

    revision: int
    #: Made by this call; else found, made by an earlier call of the same body.
    made: bool
    #: The request under the key is known to have this body (its claimant
    #: stored it, or compared it with its ``submitted`` event); else pending.
    confirmed: bool
    #: The value of the pending claim of another body this call took over
    #: (:meth:`Submissions._take_over`): what it puts back, rather than delete,
    #: when it gives the claim back.
    taken_from: bytes | None = None
    #: Pending, made by a take-over (:data:`_TAKEN`): the request under the key
    #: may be the first claim's, of another body.
    taken: bool = False


def _claimed(value: bytes) -> bytes:
    """The fingerprint a claim's value names, pending, taken over or confirmed."""
    return value.removeprefix(_TAKEN).removeprefix(_PENDING)


class Origin(NamedTuple):
    """A request's route, and when it was made (its ``submitted_at``, whole
    seconds): the ``created`` of every answer and chunk of it, resumed or not."""

    route: str
    created: int


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def no_model(route: str) -> ApiError:
    return ApiError(
        404,
        f"the model {route[:64]!r} does not exist: it must name a route (GET /v1/models)",
        code="model_not_found",
        param="model",
    )


def _key_unverified() -> ApiError:
    return ApiError(
        409,
        "a request under this Idempotency-Key is stored, but was not yet read, and was "
        "submitted without the key's body on record: its body cannot be compared with "
        "this one; send it again in a moment",
        param="Idempotency-Key",
        code="idempotency_key_unverified",
        retry_after=1,
    )


def _key_reused() -> ApiError:
    return ApiError(
        422,
        "this Idempotency-Key was used with another body",
        param="Idempotency-Key",
        code="idempotency_key_reused",
    )


def _same_request(stored: InferenceRequest, print_: str, sub: Submission) -> bool:
    """Whether ``stored``, the request under a key, is what this body asks
    (its fingerprint ``print_``, its submission ``sub``). By the fingerprint a
    gateway records in its metadata (:data:`BODY_KEY`, every gateway has); a
    request with none was not published by a gateway (a :class:`~renqueue.Client`
    or a raw publish of the tenant naming the key's id itself, or
    ``renqueue dlq requeue`` of one) and is compared by what it asks instead:
    its route (the one the client named, if a split placed it), messages and
    parameters. Joined unchecked, a call of another body would be answered
    with that request's text."""
    recorded = stored.metadata.get(BODY_KEY)
    if recorded is not None:
        return recorded == print_
    asked = stored.split or stored.route
    return (asked, stored.messages, stored.params) == (sub.route, sub.messages, sub.params)


def _maybe_stored(exc: BaseException) -> bool:
    """Whether a submit that raised ``exc`` may still have stored its request
    (a lost ack, a dropped connection), rather than surely not (refused before
    the publish, no stream, a full queue)."""
    # Refused before the publish; or the server answered (no stream, full): not stored.
    return not isinstance(
        exc,
        InvalidRequestError
        | UnknownPriorityError
        | NatsApiError
        | NatsPayloadTooLargeError
        | StoreFullError,
    )


class _Following:
    """A call of this process following a request, for a ``with`` block
    (:meth:`Submissions.following`; a class, not a generator: it is entered on
    every call)."""

    __slots__ = ("_counts", "_key")

    def __init__(self, counts: collections.Counter[tuple[str, str]], key: tuple[str, str]) -> None:
        self._counts = counts
        self._key = key

    def __enter__(self) -> None:
        self._counts[self._key] += 1

    def __exit__(self, *_exc: object) -> None:
        counts, key = self._counts, self._key
        counts[key] -= 1
        if counts[key] <= 0:
            del counts[key]


class Submissions:
    """Submits chat calls, joins their retries, cancels those whose client went away.

    ``js`` gives the gateway's JetStream of the moment (its connection may be
    renewed: then :meth:`renew`); ``client_of`` the tenant's client on it.
    """

    def __init__(
        self,
        config: Config,
        *,
        js: Callable[[], JetStream],
        client_of: Callable[[str], Client],
        supervisor: Supervisor,
    ) -> None:
        self._config = config
        self._js = js
        self._client_of = client_of
        self._supervisor = supervisor
        window = config.gateway.retry_memory or config.nats.duplicate_window
        self._memory = RetryMemory(parse_duration(window))
        self._share_ttl = str(max(1, math.ceil(self._memory.ttl)))
        duplicates = parse_duration(config.nats.duplicate_window)
        self._claim_ttl = max(1, math.ceil(_CLAIM_WINDOWS * duplicates))
        self._state: KeyValue | None = None
        #: Calls of this process following each request, by (tenant, id).
        self._following: collections.Counter[tuple[str, str]] = collections.Counter()
        self._recent: dict[tuple[str, str], Origin] = {}

    def renew(self) -> None:
        """The gateway's connection was renewed: the bucket is opened again on the new one."""
        self._state = None

    async def _bucket(self) -> KeyValue:
        if self._state is None:
            self._state = await self._js().key_value(STATE_BUCKET)
        return self._state

    # ------------------------------------------------------------ reading

    def _default_level(self, tenant: str) -> str:
        """The level of a call that names none: the config's default, or the
        tenant's ``max_priority`` when that is less urgent (a plain SDK call
        is never refused for a priority it did not ask for)."""
        config = self._config
        default = config.default_priority
        most = config.max_priority_of(tenant)
        if most is not None and config.priority_rank(most) > config.priority_rank(default):
            return most
        return default

    def read(
        self, body: bytes, headers: Mapping[str, str], tenant: str
    ) -> tuple[Submission, str | None, bool]:
        """The submission a chat body asks for, its idempotency key, and whether
        to keep it when its client disconnects; ApiError if it cannot be asked."""
        chat = parse_chat(body)
        now = time.time()
        sub = translate(
            chat,
            headers,
            levels=self._config.priorities,
            default_level=self._default_level(tenant),
            now=now,
        )
        if sub.route not in self._config.routes:
            raise no_model(sub.route)
        if sub.deadline is not None and sub.deadline <= now:
            raise ApiError(
                504,
                "the request's deadline has already passed; nothing was submitted",
                type="server_error",
                code="deadline_exceeded",
                retry=False,
            )
        key = headers.get("Idempotency-Key")
        if key is not None and not _KEY_RE.fullmatch(key):
            raise ApiError(
                400,
                f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
                param="Idempotency-Key",
                code="invalid_header",
            )
        keep = sub.keep_alive_on_disconnect
        return sub, key, key is not None if keep is None else keep

    # ------------------------------------------------------------ following

    def recent(self, tenant: str, request_id: str) -> Origin | None:
        """The route and creation of a request this process submitted lately
        (before a router may have logged it), if it is one."""
        return self._recent.get((tenant, request_id))

    def _remember_recent(self, tenant: str, request_id: str, origin: Origin) -> None:
        self._recent.setdefault((tenant, request_id), origin)
        while len(self._recent) > _RECENT:
            del self._recent[next(iter(self._recent))]

    def following(self, tenant: str, request_id: str) -> _Following:
        """One more call of this process follows the request, for a ``with`` block."""
        return _Following(self._following, (tenant, request_id))

    # ------------------------------------------------------------ submitting

    async def submit(
        self,
        client: Client,
        sub: Submission,
        print_: str,
        request_id: str,
        *,
        key: str | None,
        retry: bool,
    ) -> RequestHandle:
        """Submit ``sub`` (its body's fingerprint ``print_``) as ``request_id``,
        or join the request a retry of it already made."""
        tenant = client.tenant
        metadata = sub.metadata
        js = self._js()
        claim: _Claim | None = None
        if key is not None:
            existing = await submitted_of(js, tenant, request_id)
            if existing is not None:
                if not _same_request(existing.request, print_, sub):
                    raise _key_reused()
                metrics.RETRIES_JOINED.labels("idempotency_key").inc()
                created = int(existing.request.submitted_at)
                self._remember_recent(tenant, request_id, Origin(sub.route, created))
                return client.handle(request_id)
            # Before the publish: a resend of the key with another body, at any
            # moment after this, meets the claim and is refused.
            claim = await self._claim(tenant, request_id, print_, sub)
            if claim.confirmed:
                # Stored with this body: joined, not published again (past the
                # duplicate window, before a router read it, that would store it twice).
                metrics.RETRIES_JOINED.labels("idempotency_key").inc()
                created = await self._created_of_stored(tenant, request_id, int(time.time()))
                self._remember_recent(tenant, request_id, Origin(sub.route, created))
                return client.handle(request_id)
            metadata = {**metadata, BODY_KEY: print_}
        elif retry and (joined := await self._joinable(tenant, print_)) is not None:
            # Published again under the id the first try used: a duplicate if
            # that one was stored (joined), stored now if its publish was lost.
            metrics.RETRIES_JOINED.labels("sdk_retry").inc()
            request_id = joined
        if key is None:
            # Before the publish: one whose ack is lost may still be stored,
            # and the SDK's retry of it must join it, not make a second.
            self._memory.remember(print_, request_id)
            await self._share(tenant, print_, request_id)
        try:
            built = client.build_request(
                sub.messages,
                route=sub.route,
                priority=sub.priority,
                request_id=request_id,
                params=sub.params,
                deadline=sub.deadline,
                max_cost=sub.max_cost,
                metadata=metadata,
                # A whole answer is read from its `completed` event: no chunks.
                stream=sub.stream,
            )
            handle = await client.submit_request(built, traceparent=sub.traceparent)
        except Exception as exc:
            answer = from_error(exc)
            if key is None and not _maybe_stored(exc):
                self._forget(tenant, print_, request_id)
            elif claim is not None and claim.made and not _maybe_stored(exc):
                self._unclaim(tenant, request_id, claim)  # nothing stored: the key is free
            raise answer from exc
        if claim is not None and not claim.confirmed:
            await self._settle(tenant, request_id, print_, claim, handle, sub=sub)
        if key is not None and handle.duplicate:
            metrics.RETRIES_JOINED.labels("idempotency_key").inc()
        created = int(built.submitted_at)
        if handle.duplicate or handle.found_on_retry:
            # The stored request is an earlier try's: its creation, if known.
            created = await self._created_of_stored(tenant, handle.id, created)
        self._remember_recent(tenant, handle.id, Origin(sub.route, created))
        return handle

    async def _created_of_stored(self, tenant: str, request_id: str, built: int) -> int:
        """When the stored request ``request_id`` was made (an earlier try of a
        retry that joined it): remembered here, or its ``submitted`` event;
        ``built`` (this try's) when neither has it yet."""
        known = self.recent(tenant, request_id)
        if known is not None:
            return known.created
        stored = await submitted_of(self._js(), tenant, request_id)
        return built if stored is None else int(stored.request.submitted_at)

    async def _claim(self, tenant: str, request_id: str, print_: str, sub: Submission) -> _Claim:
        """Claim an idempotency key's request for this body (its fingerprint
        ``print_``), for :data:`_CLAIM_WINDOWS` duplicate windows, or find the
        claim of an earlier call of the same body; 422 if a call of another body
        claimed it, unless that claim was abandoned (:meth:`_take_over`). The
        one place a key's body is decided: a compare-and-set, whichever gateway
        process asks. A claim is made pending, and confirmed once the request
        under the key is known to have its body."""
        state = await self._bucket()
        name = claim_key(tenant, request_id)
        value = print_.encode()
        for _ in range(3):
            try:
                revision = await state.create(name, _PENDING + value, msg_ttl=self._claim_ttl)
                return _Claim(revision, made=True, confirmed=False)
            except WrongLastSequenceError:
                pass
            entry = await state.latest(name)
            if entry is None or entry.operation is not None:
                continue  # expired or deleted since: claimed again
            if _claimed(entry.value) == value:
                confirmed = not entry.value.startswith(_PENDING)
                by_take_over = entry.value.startswith(_TAKEN)
                return _Claim(entry.revision, made=False, confirmed=confirmed, taken=by_take_over)
            if not entry.value.startswith(_PENDING):
                raise _key_reused()  # the request under the key has another body
            taken = await self._take_over(tenant, request_id, print_, sub, entry.revision)
            if taken is not None:
                return taken
            # Moved on meanwhile (settled, given back, taken by another call): read again.
        raise _key_unverified()  # claimed and gone again, three times in a row

    async def _take_over(
        self, tenant: str, request_id: str, print_: str, sub: Submission, revision: int
    ) -> _Claim | None:
        """Take over the pending claim of another body at ``revision`` if it was
        abandoned; ``None`` if it moved on (read it again); 422 if it stands.

        A live claimer settles its claim within moments of its publish
        (confirmed, or given back). One still pending, unchanged, after
        :data:`_CLAIMER_GONE_AFTER` seconds, with no ``submitted`` event under
        the key, was left by a call that went away between its claim and its
        publish (a gateway killed; Stripe's "a key whose first request never
        completed may be used again"): this call takes it over, by a
        compare-and-set on that revision, so of two calls (two gateway
        processes) one takes it; the other reads the winner's claim. The
        claimer may have stored its request and gone before confirming, and no
        router read it yet: the publish that follows is then a duplicate, and
        its check (:meth:`_same_body`) puts the abandoned claim back and
        answers 422 or 409 rather than join it (within the duplicate window;
        past it, a request stored and unread that long would be stored a
        second time, as for a claim expired: docs/gateway.md)."""
        state = await self._bucket()
        name = claim_key(tenant, request_id)
        deadline = time.monotonic() + _CLAIMER_GONE_AFTER
        while True:
            entry = await state.latest(name)
            if entry is None or entry.operation is not None or entry.revision != revision:
                return None
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.25)
        existing = await submitted_of(self._js(), tenant, request_id)
        if existing is not None and not _same_request(existing.request, print_, sub):
            raise _key_reused()
        try:
            ack = await self._write_at(name, _TAKEN + print_.encode(), revision, self._claim_ttl)
        except WrongLastSequenceError:
            return None  # another call took it first, or its claimer settled it
        log.info("an abandoned Idempotency-Key claim was taken over", request_id=request_id)
        return _Claim(ack.seq, made=True, confirmed=False, taken_from=entry.value, taken=True)

    async def _settle(
        self,
        tenant: str,
        request_id: str,
        print_: str,
        claim: _Claim,
        handle: RequestHandle,
        *,
        sub: Submission,
    ) -> None:
        """A pending claim after its call's publish: confirmed if the publish
        stored the request; else checked (:meth:`_same_body`)."""
        if handle.duplicate or handle.found_on_retry:
            ours = claim.made and claim.taken_from is None and handle.found_on_retry
            await self._same_body(tenant, request_id, print_, sub, claim, ours=ours)
        else:
            self._confirm(tenant, request_id, print_, claim)

    def _confirm(self, tenant: str, request_id: str, print_: str, claim: _Claim) -> None:
        """The request under the key has the claimed body: later calls of it join
        it unchecked. Written in the background (a compare-and-set on the
        claim's revision, its life starting again), so the answer does not wait;
        until it lands, a call of the same body that finds the request stored
        compares its body as for a pending claim."""
        name = claim_key(tenant, request_id)

        async def confirm() -> None:
            with contextlib.suppress(WrongLastSequenceError):  # moved on: not ours to say
                await self._write_at(name, print_.encode(), claim.revision, self._claim_ttl)

        with contextlib.suppress(RuntimeError):  # the gateway is stopping: left pending
            self._supervisor.spawn_job(f"confirm-{name}", confirm)

    def _unclaim(self, tenant: str, request_id: str, claim: _Claim) -> None:
        """Take back this call's claim of a key (at its revision, no later one):
        nothing was stored under it, or what is stored is not known to be its body.
        A claim taken over (:meth:`_take_over`) is given back as it was found:
        pending for its first body, whose calls may still join what it stored."""
        name = claim_key(tenant, request_id)

        async def delete() -> None:
            with contextlib.suppress(WrongLastSequenceError):
                if claim.taken_from is None:
                    await self._delete(name, claim.revision, self._claim_ttl)
                else:
                    await self._write_at(name, claim.taken_from, claim.revision, self._claim_ttl)

        with contextlib.suppress(RuntimeError):  # the gateway is stopping: it expires instead
            self._supervisor.spawn_job(f"unclaim-{name}", delete)

    async def _same_body(
        self,
        tenant: str,
        request_id: str,
        print_: str,
        sub: Submission,
        claim: _Claim,
        *,
        ours: bool,
    ) -> None:
        """A keyed submit whose claim is pending found the key's request stored:
        by the call that made the claim (the same body), or by a publisher that
        took no claim (a gateway of an earlier version, a
        :class:`~renqueue.Client` naming the id itself, a claim gone while
        JetStream still knew the id); when ``ours`` (found by a retry of the
        publish of this call, which made the claim), all but surely by this
        call's own first try. Compared with its ``submitted`` event, waited for
        about 3 s: the same body confirms the claim, another is a 422; none by
        then is a 409 (never joined unchecked) unless ``ours``, or the claim is
        another call's (of this very body: another's was a 422 already) and is
        still pending, unchanged, :data:`_CLAIMER_GONE_AFTER` seconds later (a
        live claimer settles it within its own wait): that call's publish
        stored the request and it went away before confirming (killed, or
        cancelled by its client's timeout), so the request is joined rather
        than refused until a router reads it (not a claim made by a take-over:
        :data:`_TAKEN`). A claim another
        call confirms meanwhile (its publish stored the request) is joined. A
        claim this call made is taken back when the stored request is not known
        to have its body."""
        state = await self._bucket()
        name = claim_key(tenant, request_id)
        delay = 0.05
        for _ in range(6):
            existing = await submitted_of(self._js(), tenant, request_id)
            if existing is not None:
                if not _same_request(existing.request, print_, sub):
                    if claim.made:
                        self._unclaim(tenant, request_id, claim)
                    raise _key_reused()
                self._confirm(tenant, request_id, print_, claim)
                return
            entry = await state.latest(name)
            if entry is not None and entry.operation is None and entry.value == print_.encode():
                return  # confirmed by the call whose publish stored it
            await asyncio.sleep(delay)
            delay *= 2
        if ours:
            # Unless another call took this claim over meanwhile (this call's
            # publish took longer than the grace): the request found may be its.
            # Pending as this call made it (or put back so), not a claim of its
            # body taken over by a later call (:data:`_TAKEN`): that one may
            # have taken it from a call of another body that stored its request.
            entry = await state.latest(name)
            ours = entry is not None and entry.value == _PENDING + print_.encode()
        # A claim taken over is not trusted so: its call's publish may have
        # met the first claim's request, of another body, and not come back.
        gone = not claim.made and not claim.taken
        if ours or (gone and await self._claimer_gone(name, print_, claim)):
            self._confirm(tenant, request_id, print_, claim)
            return
        if claim.made:
            self._unclaim(tenant, request_id, claim)
        raise _key_unverified()

    async def _claimer_gone(self, name: str, print_: str, claim: _Claim) -> bool:
        """Whether the request under the pending claim ``name`` another call made
        for this body (at ``claim.revision``) may be joined: the claim is
        confirmed meanwhile, or still pending at that revision
        :data:`_CLAIMER_GONE_AFTER` seconds on (left by a call that went away:
        a live claimer confirms it or takes it back within its own wait)."""
        state = await self._bucket()
        deadline = time.monotonic() + _CLAIMER_GONE_AFTER
        while time.monotonic() < deadline:
            entry = await state.latest(name)
            if entry is None or entry.operation is not None:
                return False  # taken back: what is stored is not known to be this body
            if entry.revision != claim.revision:
                return entry.value == print_.encode()  # confirmed, or claimed anew

            await asyncio.sleep(0.25)
        return True

    async def _delete(self, name: str, revision: int, ttl: int | str) -> None:
        """Delete entry ``name`` of the ``rq-state`` bucket at ``revision`` (a
        compare-and-set: :class:`WrongLastSequenceError` if it moved on), by a
        delete marker that expires in ``ttl`` seconds, as the entry would have:
        ``rq-state`` has no ``max_age``, and a plain KV delete's marker (nats-py
        sets no TTL on one) would be kept for ever, one per key given back."""
        await self._write_at(name, b"", revision, ttl, operation="DEL")

    async def _write_at(
        self, name: str, value: bytes, revision: int, ttl: int | str, *, operation: str = ""
    ) -> PubAck:
        """Write entry ``name`` of the ``rq-state`` bucket at ``revision`` (a
        compare-and-set: :class:`WrongLastSequenceError` if it moved on), to live
        ``ttl`` seconds from now; ``operation`` ``"DEL"``: a delete marker."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(revision), "Nats-TTL": str(ttl)}
        if operation:
            headers["KV-Operation"] = operation
        return await self._js().publish(f"$KV.{STATE_BUCKET}.{name}", value, headers=headers)

    # ------------------------------------------------------------ remembering

    def _forget(self, tenant: str, print_: str, request_id: str) -> None:
        """Retries of this body no longer join ``request_id`` (it was never
        stored, or its client went away and it is being cancelled)."""
        if self._memory.recall(print_) != request_id:
            return  # a newer request of the same body: its own
        self._memory.forget(print_)
        name = shared_key(tenant, print_)

        async def delete() -> None:
            state = await self._bucket()
            entry = await state.latest(name)
            # Only ours: another process may have shared the same body since.
            if entry is not None and entry.value == request_id.encode():
                with contextlib.suppress(WrongLastSequenceError):
                    await self._delete(name, entry.revision, self._share_ttl)

        self._supervisor.spawn_job(f"forget-{name}", delete)

    async def _share(self, tenant: str, print_: str, request_id: str) -> None:
        """Tell every gateway process which request this body made; the answer
        does not wait for it.

        Published at once, in the same write to the broker as the request's own
        publish that follows, and its ack is read by a callback rather than
        awaited: no task (one timer bounds the wait for it). A publish that raises, or an ack that
        is an error or never comes, hands the write to a supervised
        background job, which retries it until it is stored (the newest
        request of the body then, if this process still remembers one)."""
        name = shared_key(tenant, print_)
        subject = f"$KV.{STATE_BUCKET}.{name}"
        value = request_id.encode()
        headers = {"Nats-TTL": self._share_ttl}

        def again(reason: BaseException | None) -> None:
            log.info(
                "sharing a body fingerprint failed; retrying",
                error=repr(reason) if reason else "no ack in time",
            )

            async def put() -> None:
                # The newest request of this body this process made, read at
                # each try: a later call of the body may have been made since
                # (this job, running, kept its own write from starting), and
                # one forgotten (never stored, or its client went away) is not
                # shared again after ``_forget`` deleted it.
                newest = self._memory.recall(print_)
                if newest is not None:
                    await self._js().publish(subject, newest.encode(), headers=headers)

            with contextlib.suppress(RuntimeError):  # the gateway is stopping
                self._supervisor.spawn_job(f"share-{name}", put)

        try:
            ack = await self._js().publish_async(subject, value, headers=headers)
        except Exception as exc:  # noqa: BLE001 - the supervised job retries it
            again(exc)
            return
        late = asyncio.get_running_loop().call_later(_SHARE_ACK_WAIT, ack.cancel)

        def acked(ack: asyncio.Future[PubAck]) -> None:
            late.cancel()
            if ack.cancelled():
                again(None)
            elif (exc := ack.exception()) is not None:
                again(exc)

        ack.add_done_callback(acked)

    async def _shared(self, tenant: str, print_: str) -> str | None:
        """The request another gateway process made of this body, if it shared it."""
        state = await self._bucket()
        try:
            entry = await state.get(shared_key(tenant, print_))
        except NatsNotFoundError:
            return None
        request_id = entry.value.decode("utf-8", "replace")
        return request_id if ID_RE.fullmatch(request_id) else None

    async def _joinable(self, tenant: str, print_: str) -> str | None:
        """The request an SDK retry repeats, if this process remembers it and it
        was not cancelled because its client went away (that one is retried anew)."""
        request_id = self._memory.recall(print_) or await self._shared(tenant, print_)
        if request_id is None:
            return None
        if await self._cancelled_by_disconnect(tenant, request_id):
            return None  # being cancelled, or cancelled: this retry runs anew
        return request_id

    async def _cancelled_by_disconnect(self, tenant: str, request_id: str) -> bool:
        # In the log, or stored in RQ_CANCELS and not yet sourced into it.
        try:
            raw = await self._js().get_last_msg(
                EVENTS_STREAM, event_subject(tenant, request_id, "cancel_requested"), direct=True
            )
        except NatsNotFoundError:
            try:
                raw = await self._js().get_last_msg(
                    CANCELS_STREAM, cancel_subject(tenant, request_id), direct=True
                )
            except NatsNotFoundError:
                return False
        with contextlib.suppress(msgspec.DecodeError):
            event = EVENT_DECODER.decode(raw.data or b"")
            return isinstance(event, CancelRequested) and event.reason == DISCONNECTED
        return False

    # ------------------------------------------------------------ cancelling

    def cancel_later(
        self, client: Client, request_id: str, print_: str, *, following: bool = True
    ) -> None:
        """Record a cancellation for a client that went away (a supervised job:
        the handler that asks is itself being cancelled), unless another call
        in this process still follows the request (an SDK retry that joined
        it); retries of its body no longer join it."""
        others = self._following.get((client.tenant, request_id), 0) - (1 if following else 0)
        if others > 0:
            log.info(
                "client disconnected; a retry still follows its request", request_id=request_id
            )
            return
        tenant = client.tenant
        self._forget(tenant, print_, request_id)
        log.info("client disconnected; cancelling its request", request_id=request_id)

        async def cancel() -> None:
            # The tenant's client of the moment: the gateway may have moved
            # onto a new connection since (see Gateway._renew).
            await self._client_of(tenant).handle(request_id).cancel(DISCONNECTED)

        self._supervisor.spawn_job(f"cancel-{tenant}:{request_id}", cancel)
