"""Coalescing: identical requests of one tenant share one backend call.

Requests are identical when they carry the same ``dedupe_key``, or, when they
ask for it (``coalesce=True``), the same route, messages and parameters. The
first one a router reads becomes the group's *leader* and is routed as usual;
the others become *followers*: a ``coalesced`` event, and they leave the queue.

Every follower ends with exactly one terminal event of its own, whatever
happens to the leader (:meth:`Coalescer.leader_ended`, called wherever a
leader ends: the worker after a call, the router when it expires, cancels or
cannot deliver a leader, the advisory reader when its message ran out of
deliveries; and again, since it is idempotent, by whoever finds a leader
already ended: a worker handed its dispatch, the advisory reader):

- the leader **completed**: each follower gets the same text (its final
  token chunk carries it all; for a request that did not say ``stream``, a
  chunk of its own before an empty final one; none for ``stream`` false)
  and a ``completed`` copy with ``shared_with`` = the leader and no
  cost (the spend is the leader's);
- the leader's **backend call failed** for good: each follower gets
  ``failed`` (``error_type`` ``shared_call_failed``): the same call would fail
  again;
- the leader ended for a reason of **its own** (cancelled, expired, rejected,
  undeliverable): its followers run on their own. Each is put back on its
  priority subject (its request read from its ``submitted`` event, a requeue
  message id), where the first one read leads a new group and the others
  join it. Why not promote one follower in place: the requeue path is the one
  every request already takes after a preemption, so it needs no second
  mechanism, and it keeps each follower's own priority and deadline.

A follower's own cancellation and deadline hold while it waits: a cancelled
follower ends ``cancelled`` at once (:meth:`Coalescer.follower_cancelled`,
from any router's cancel listener); its deadline is kept in the group, and a
follower past it when the call ends gets ``expired`` instead of the copy (the
router that coalesced it also expires it on time). Such a follower is ended
first (its terminal claim and event) and leaves its group after, so a
failure or a crash in between leaves it in the group, where the hand-out
finds its claim and skips it; the router runs both as supervised jobs
(:meth:`renqueue.tasks.Supervisor.spawn_job`), retried with a capped
backoff until they succeed. The terminal claim in
:meth:`renqueue.broker.EventLog.finish` makes sure only one of these
outcomes is ever recorded for a follower.

The group lives in the ``rq-state`` KV bucket under ``co.<tenant>.<key>``,
changed only by compare-and-set, so any number of routers and workers agree
on who leads and who follows. A group whose leader is already over (its
hand-out never ran: a crash, or a leader re-read after it ended) is dead: the
next request to join it finishes the hand-out first and then leads a new
group, so no one ever joins a dead leader. The hand-out itself is resumable:
the group is closed first (no one joins after that), each follower's outcome
is idempotent, and the group is marked done only at the end, so whoever runs
it again (a redelivery, the next joiner) completes it.

Groups expire. Each write carries a ``Nats-TTL`` of the group's ``ttl``
(``router.coalesce_ttl``, set by its creator), so a group no one touches for
that long is gone, whatever state it was left in, and so is the ``done``
marker a finished hand-out leaves. The bucket is not the record of who
follows whom; the log is: each follower's ``coalesced`` event names its
leader. A leader's hand-out that finds no group of its own (it expired while
the leader waited, or a newcomer replaced it once it was closed), or one it
created again after the first expired, looks its followers up in the log
(:func:`~._coalescing_log.followers_in_log`), so each still ends exactly once.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Final

import msgspec

from ..broker import (
    EventLog,
    JetStream,
    KeyValue,
    publish_stored,
    submitted_of,
)
from ..errors import NatsNotFoundError, WrongLastSequenceError
from ..logs import get_logger
from ..schema import (
    EVENTS_STREAM,
    STATE_BUCKET,
    ChunkTail,
    Completed,
    Event,
    Failed,
    InferenceRequest,
    TokenChunk,
    cancelled,
    encode,
    error_type_of,
    event_subject,
    expired,
    failed,
    msg_id,
    request_subject,
    token_subject,
    tool_call_deltas,
)
from ._coalescing_log import followers_in_log, preempted_attempt

__all__ = ["Coalescer", "Group", "coalesce_key"]

log = get_logger("coalescing")

_TRIES: Final = 8


def coalesce_key(request: InferenceRequest) -> str | None:
    """The group a request belongs to, or ``None`` when it does not coalesce.

    By the route the client named (``split``, when an A/B split moved it to
    an arm): the key stays the same whatever arm the request is on, or is
    moved to.
    """
    if request.dedupe_key is not None:
        return request.dedupe_key
    if not request.coalesce:
        return None
    route = request.split or request.route
    body = msgspec.json.encode((route, request.messages, request.params))
    return hashlib.sha256(body).hexdigest()[:40]


class Group(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    followers: list[str] = []
    closed: bool = False
    #: Followers' deadlines (Unix s), for those that have one.
    deadlines: dict[str, float] = {}
    #: Seconds each write of the group lives in the bucket (its ``Nats-TTL``),
    #: set by its creator (``router.coalesce_ttl``); 0: it never expires.
    ttl: float = 0.0
    #: When its leader created it (the creator's clock, Unix s); 0: unknown.
    created: float = 0.0
    #: The hand-out is over: what is left is a marker that expires after ``ttl``.
    done: bool = False


_DECODER: Final = msgspec.json.Decoder(Group)


def _without(group: Group, follower: str) -> Group:
    return msgspec.structs.replace(
        group,
        followers=[f for f in group.followers if f != follower],
        deadlines={f: d for f, d in group.deadlines.items() if f != follower},
    )


def _whole_seconds(ttl: float) -> int:
    """A ``Nats-TTL`` in whole seconds (the server's unit), at least 1."""
    return max(1, math.ceil(ttl))


def _ttl_header(ttl: float) -> dict[str, str]:
    """The ``Nats-TTL`` header for ``ttl`` seconds, if any."""
    return {"Nats-TTL": str(_whole_seconds(ttl))} if ttl > 0 else {}


class Coalescer:
    """Joining groups, and giving every follower its outcome when its leader ends."""

    def __init__(
        self, js: JetStream, *, clock: Callable[[], float] = time.time, ttl: float = 0.0
    ) -> None:
        self._js = js
        self._log = EventLog(js)
        self._clock = clock
        #: Lifetime of the groups this one creates (each write renews it); 0: none.
        self._ttl = ttl
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._js.key_value(STATE_BUCKET)
        return self._kv

    @staticmethod
    def _key(tenant: str, key: str) -> str:
        return f"co.{tenant}.{key}"

    def _new_group(self, leader: str) -> Group:
        return Group(leader=leader, ttl=self._ttl, created=self._clock())

    async def _write(self, name: str, group: Group, *, last: int) -> None:
        """Replace revision ``last`` of group ``name`` (compare-and-set), the new
        value living ``group.ttl`` seconds (every write renews it)."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last), **_ttl_header(group.ttl)}
        await self._js.publish(
            f"$KV.{STATE_BUCKET}.{name}", msgspec.json.encode(group), headers=headers
        )

    # ------------------------------------------------------------- joining

    async def join(self, request: InferenceRequest, key: str) -> str | None:
        """Join ``request``'s group: ``None`` if it leads, else the leader's id.

        A group whose leader has already ended is settled (its hand-out
        finished) and replaced: nobody joins a dead leader.
        """
        kv = await self._bucket()
        name = self._key(request.tenant, key)
        for _ in range(_TRIES):
            mine = self._new_group(request.id)
            try:
                ttl = _whole_seconds(mine.ttl) if mine.ttl > 0 else None
                await kv.create(name, msgspec.json.encode(mine), msg_ttl=ttl)
            except WrongLastSequenceError:
                pass
            else:
                return None
            try:
                entry = await kv.get(name)
            except NatsNotFoundError:
                continue  # deleted meanwhile: try to create it again
            group = _DECODER.decode(entry.value)
            if group.leader == request.id:
                return None  # a redelivery of the leader
            if request.id in group.followers and not group.closed:
                return group.leader  # a redelivery of a follower
            # In a closed group it is being handed out: put back on its queue
            # to run alone, it leads a new group (the claim keeps one outcome).
            if not group.closed:
                ended = await self._log.terminal_of(request.tenant, group.leader)
                if ended is not None:
                    log.info("coalescing group of an ended leader settled", leader=group.leader)
                    await self.leader_ended(request.tenant, group.leader, key, ended)
                    continue
            deadlines = dict(group.deadlines)
            if request.deadline is not None:
                deadlines[request.id] = request.deadline
            changed = (
                self._new_group(request.id)
                if group.closed
                else msgspec.structs.replace(
                    group, followers=[*group.followers, request.id], deadlines=deadlines
                )
            )
            try:
                await self._write(name, changed, last=entry.revision)
            except WrongLastSequenceError:
                continue
            return None if group.closed else group.leader
        raise RuntimeError(f"could not join coalescing group {name} after {_TRIES} tries")

    async def leave(self, tenant: str, key: str, follower: str) -> None:
        """Take ``follower`` out of its (open) group: it ends on its own."""
        kv = await self._bucket()
        name = self._key(tenant, key)
        for _ in range(_TRIES):
            try:
                entry = await kv.get(name)
            except NatsNotFoundError:
                return
            group = _DECODER.decode(entry.value)
            if group.closed or follower not in group.followers:
                return  # not there, or being handed out: the claim picks one outcome
            try:
                await self._write(name, _without(group, follower), last=entry.revision)
            except WrongLastSequenceError:
                continue
            return

    # ----------------------------------------------------------- handing out

    async def leader_ended(self, tenant: str, leader: str, key: str, outcome: Event) -> None:
        """Give every follower of ``leader``'s group its outcome. Idempotent.

        Call it before recording the leader's own terminal event: a crash in
        between leaves the leader's message to be handled again, which runs
        this again and finishes what was left.
        """
        group = await self._close(tenant, key, leader)
        if group is not None and group.done:
            return  # handed out already
        followers: dict[str, float | None] = {}
        if group is not None:
            followers = {f: group.deadlines.get(f) for f in group.followers}
        if group is None or not await self._complete(tenant, leader, group):
            # The group may have expired (or been replaced) while the leader
            # waited: its followers are in the log, each by its `coalesced`.
            for follower in await followers_in_log(self._js, tenant, leader):
                if follower not in followers:
                    request = await self._submitted(tenant, follower)
                    followers[follower] = None if request is None else request.deadline
        for follower, deadline in followers.items():
            await self._settle(tenant, leader, follower, deadline, outcome)
        if group is not None:
            await self._forget(tenant, key, leader)

    async def _close(self, tenant: str, key: str, leader: str) -> Group | None:
        """Close the group ``leader`` leads (no one joins after); the group, or None."""
        kv = await self._bucket()
        name = self._key(tenant, key)
        for _ in range(_TRIES):
            try:
                entry = await kv.get(name)
            except NatsNotFoundError:
                return None
            group = _DECODER.decode(entry.value)
            if group.leader != leader:
                return None  # not (or no longer) the leader: its followers are in the log
            if group.closed:
                return group
            closed = msgspec.structs.replace(group, closed=True)
            try:
                await self._write(name, closed, last=entry.revision)
            except WrongLastSequenceError:
                continue
            return closed
        raise RuntimeError(f"could not close coalescing group {name} after {_TRIES} tries")

    async def _forget(self, tenant: str, key: str, leader: str) -> None:
        """Mark a closed group done once its followers have their outcomes.

        The marker (``done``) lives the group's ``ttl``: a late repeat of the
        hand-out (a redelivery, a worker that finds the leader ended) finds it
        and does nothing, and the next request to join replaces it. A group
        without a ``ttl`` (written by earlier versions) is deleted instead.
        """
        kv = await self._bucket()
        name = self._key(tenant, key)
        try:
            entry = await kv.get(name)
        except NatsNotFoundError:
            return
        group = _DECODER.decode(entry.value)
        if group.leader != leader:
            return
        try:
            if group.ttl > 0:
                done = msgspec.structs.replace(group, followers=[], deadlines={}, done=True)
                await self._write(name, done, last=entry.revision)
            else:
                await kv.delete(name, last=entry.revision)
        except WrongLastSequenceError:
            return  # replaced meanwhile (a new group): not ours to mark

    async def _complete(self, tenant: str, leader: str, group: Group) -> bool:
        """Whether ``group`` (led by ``leader``) surely lists all its followers.

        Not if it may have expired while its leader waited and been created
        anew by the leader, read again: a re-created group was created at
        least ``ttl`` after the leader was submitted (its first one lived that
        long), so a group created within half of that is the first.
        """
        if group.ttl <= 0 or group.created <= 0:
            return True  # never expires: nothing can have been lost
        submitted = await submitted_of(self._js, tenant, leader)
        return submitted is not None and group.created - submitted.at < group.ttl / 2

    async def _settle(
        self, tenant: str, leader: str, follower: str, deadline: float | None, outcome: Event
    ) -> None:
        claim = await self._log.claim_of(tenant, follower)
        if claim is not None:
            # It ended on its own (cancelled, expired) and had not left the
            # group yet: nothing to give it (its event may still be missing).
            await self._log.settle(claim)
            return
        now = self._clock()
        if isinstance(outcome, Completed):
            if deadline is not None and now >= deadline:
                await self._log.finish(
                    expired(
                        follower,
                        tenant,
                        at=now,
                        stage="queued",
                        reason=f"deadline passed while sharing the call of {leader}",
                    )
                )
                return
            copy = msgspec.structs.replace(
                outcome, request_id=follower, tenant=tenant, at=now, cost=0.0, shared_with=leader
            )
            request = await self._submitted(tenant, follower)
            stream = None if request is None else request.stream
            if stream is True:
                # The whole answer in its final chunk (one chunk, in the claim).
                await self._log.finish(copy, delivery=1, seq=0, tail=ChunkTail())
            elif stream is False:
                await self._log.finish(copy, stream=False)  # no chunk at all
            else:
                # A client that may drop a final chunk's text (it did not say
                # `stream`): the answer in a chunk of its own, as before.
                shared = bool(copy.text or copy.tool_calls or copy.logprobs)
                if shared:
                    chunk = TokenChunk(
                        request_id=follower,
                        seq=0,
                        text=copy.text,
                        tool_calls=tool_call_deltas(copy.tool_calls, 0),
                        logprobs=copy.logprobs,
                    )
                    await self._js.publish(
                        token_subject(tenant, follower),
                        encode(chunk),
                        headers={"Nats-Msg-Id": msg_id(tenant, follower, "shared")},
                    )
                await self._log.finish(copy, delivery=1, seq=1 if shared else 0)
        elif (
            isinstance(outcome, Failed)
            and outcome.backend is not None
            and (outcome.error_type != "undeliverable")
        ):
            reason = f"the call shared with {leader} failed: {outcome.error_type}"
            request = await self._submitted(tenant, follower)
            if request is not None:
                # As for any failed request: a copy an operator can requeue
                # (renqueue dlq), the follower's own request.
                await self._log.dead_letter(
                    "requests",
                    encode(request),
                    reason=f"shared_call_failed: {reason}",
                    source_subject=request_subject(request.priority, tenant),
                    tenant=tenant,
                    request_id=follower,
                )
            await self._log.finish(
                failed(
                    follower,
                    tenant,
                    at=now,
                    error_type="shared_call_failed",
                    reason=reason,
                    backend=outcome.backend,
                    error_class=outcome.error_class,
                )
            )
        else:
            await self._run_alone(tenant, leader, follower, outcome)

    async def _run_alone(self, tenant: str, leader: str, follower: str, outcome: Event) -> None:
        """Put a follower back on its priority subject: its leader ended for a
        reason of its own (cancelled, expired, ...), not for a fault of the call."""
        request = await self._submitted(tenant, follower)
        if request is None:
            # Cannot happen for a follower a router read (its `submitted` comes
            # first); if it does, end it rather than leave it waiting.
            kind = type(outcome).__name__.lower()
            await self._log.finish(
                failed(
                    follower,
                    tenant,
                    at=self._clock(),
                    error_type=error_type_of(f"shared_call_{kind}"),
                    reason=f"the call shared with {leader} ended {kind}",
                )
            )
            return
        # A routing attempt of its own that no earlier one used: it may have
        # been preempted (and dispatched again) before it joined, and a reused
        # attempt's dispatch message id would be dropped as a duplicate.
        preempted = await preempted_attempt(self._js, tenant, follower)
        requeues = max(request.requeues, preempted) + 1
        again = msgspec.structs.replace(request, requeues=requeues)
        # The group forgets it after this: a copy must surely be stored (a
        # tenant may have taken this message id first, see publish_stored).
        await publish_stored(
            self._js,
            request_subject(request.priority, tenant, requeue=True),
            encode(again),
            msg_id(tenant, follower, "requeue", "leader", leader),
        )
        log.info("coalesced request runs on its own", request_id=follower, leader=leader)

    async def _submitted(self, tenant: str, request_id: str) -> InferenceRequest | None:
        event = await submitted_of(self._js, tenant, request_id)
        return None if event is None else event.request

    # ------------------------------------------------------ follower's own end

    async def follower_cancelled(self, tenant: str, request_id: str) -> bool:
        """End a coalesced follower that was cancelled; False if it is no follower.

        Reads the request's ``coalesced`` and ``submitted`` events (a follower
        is held by no router, so the log is where it is found).
        """
        subject = event_subject(tenant, request_id, "coalesced")
        try:
            await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
        except NatsNotFoundError:
            return False
        await self._log.finish(
            cancelled(
                request_id,
                tenant,
                at=self._clock(),
                stage="queued",
                reason="cancelled by request while sharing another request's call",
            )
        )
        request = await self._submitted(tenant, request_id)
        key = coalesce_key(request) if request is not None else None
        if key is not None:
            await self.leave(tenant, key, request_id)
        return True

    async def follower_expired(self, request: InferenceRequest, key: str) -> None:
        """End a coalesced follower whose deadline passed while it waited."""
        await self._log.finish(
            expired(
                request.id,
                request.tenant,
                at=self._clock(),
                stage="queued",
                reason="deadline passed while sharing another request's call",
            )
        )
        await self.leave(request.tenant, key, request.id)
