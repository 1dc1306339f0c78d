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

- the leader **completed**: each follower gets the same text (one token
  chunk) and a ``completed`` copy with ``shared_with`` = the leader and no
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
:meth:`renqueue.eventlog.EventLog.finish` makes sure only one of these
outcomes is ever recorded for a follower.

The group lives in the ``rq-state`` KV bucket under ``co.<tenant>.<key>``,
changed only by compare-and-set, so any number of routers and workers agree
on who leads and who follows. A group whose leader is already over (its
hand-out never ran: a crash, or a leader re-read after it ended) is dead: the
next request to join it finishes the hand-out first and then leads a new
group, so no one ever joins a dead leader. The hand-out itself is resumable:
the group is closed first (no one joins after that), each follower's outcome
is idempotent, and the group is deleted only at the end, so whoever runs it
again (a redelivery, the next joiner) completes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Final

import msgspec
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)

from .eventlog import EventLog, publish_stored
from .logs import get_logger
from .messages import (
    EVENT_DECODER,
    Cancelled,
    Completed,
    Event,
    Expired,
    Failed,
    InferenceRequest,
    Submitted,
    TokenChunk,
    encode,
)
from .subjects import (
    EVENTS_STREAM,
    STATE_BUCKET,
    event_subject,
    msg_id,
    request_subject,
    token_subject,
)

__all__ = ["Coalescer", "Group", "coalesce_key"]

log = get_logger("coalescing")

_TRIES: Final = 8
#: JetStream's "wrong last sequence" (a compare-and-set lost).
_WRONG_LAST_SEQUENCE: Final = 10071


def coalesce_key(request: InferenceRequest) -> str | None:
    """The group a request belongs to, or ``None`` when it does not coalesce."""
    if request.dedupe_key is not None:
        return request.dedupe_key
    if not request.coalesce:
        return None
    body = msgspec.json.encode((request.route, request.messages, request.params))
    return hashlib.sha256(body).hexdigest()[:40]


class Group(msgspec.Struct, frozen=True, kw_only=True):
    leader: str
    followers: list[str] = []
    closed: bool = False
    #: Followers' deadlines (Unix s), for those that have one.
    deadlines: dict[str, float] = {}


_DECODER: Final = msgspec.json.Decoder(Group)


def _without(group: Group, follower: str) -> Group:
    return Group(
        leader=group.leader,
        followers=[f for f in group.followers if f != follower],
        closed=group.closed,
        deadlines={f: d for f, d in group.deadlines.items() if f != follower},
    )


class Coalescer:
    """Joining groups, and giving every follower its outcome when its leader ends."""

    def __init__(self, js: Any, *, clock: Callable[[], float]) -> None:
        self._js = js
        self._log = EventLog(js)
        self._clock = clock
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await self._js.key_value(STATE_BUCKET)
        return self._kv

    @staticmethod
    def _key(tenant: str, key: str) -> str:
        return f"co.{tenant}.{key}"

    # ------------------------------------------------------------- joining

    async def join(self, request: InferenceRequest, key: str) -> str | None:
        """Join ``request``'s group: ``None`` if it leads, else the leader's id.

        A group whose leader has already ended is settled (its hand-out
        finished) and replaced: nobody joins a dead leader.
        """
        kv = await self._bucket()
        name = self._key(request.tenant, key)
        mine = msgspec.json.encode(Group(leader=request.id))
        for _ in range(_TRIES):
            try:
                await kv.create(name, mine)
            except KeyWrongLastSequenceError:
                pass
            else:
                return None
            try:
                entry = await kv.get(name)
            except KeyNotFoundError:
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
                Group(leader=request.id)
                if group.closed
                else Group(
                    leader=group.leader,
                    followers=[*group.followers, request.id],
                    deadlines=deadlines,
                )
            )
            try:
                await kv.update(name, msgspec.json.encode(changed), last=entry.revision)
            except KeyWrongLastSequenceError:
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
            except KeyNotFoundError:
                return
            group = _DECODER.decode(entry.value)
            if group.closed or follower not in group.followers:
                return  # not there, or being handed out: the claim picks one outcome
            try:
                await kv.update(
                    name, msgspec.json.encode(_without(group, follower)), last=entry.revision
                )
            except KeyWrongLastSequenceError:
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
        if group is None:
            return
        for follower in group.followers:
            await self._settle(tenant, leader, follower, group.deadlines.get(follower), outcome)
        await self._forget(tenant, key, leader)

    async def _close(self, tenant: str, key: str, leader: str) -> Group | None:
        """Close the group ``leader`` leads (no one joins after); the group, or None."""
        kv = await self._bucket()
        name = self._key(tenant, key)
        for _ in range(_TRIES):
            try:
                entry = await kv.get(name)
            except KeyNotFoundError:
                return None
            group = _DECODER.decode(entry.value)
            if group.leader != leader:
                return None  # not (or no longer) the leader: nothing to hand out
            if group.closed:
                return group
            closed = msgspec.structs.replace(group, closed=True)
            try:
                await kv.update(name, msgspec.json.encode(closed), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return closed
        raise RuntimeError(f"could not close coalescing group {name} after {_TRIES} tries")

    async def _forget(self, tenant: str, key: str, leader: str) -> None:
        """Drop a closed group once its followers have their outcomes."""
        kv = await self._bucket()
        name = self._key(tenant, key)
        try:
            entry = await kv.get(name)
        except KeyNotFoundError:
            return
        if _DECODER.decode(entry.value).leader == leader:
            try:
                await kv.delete(name, last=entry.revision)
            except BadRequestError as exc:
                # Changed meanwhile (a new group replaced the closed one): it is
                # not ours to drop. nats-py raises a plain BadRequestError for a
                # delete's wrong last sequence, not KeyWrongLastSequenceError.
                if exc.err_code != _WRONG_LAST_SEQUENCE:
                    raise

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
                    Expired(
                        request_id=follower,
                        tenant=tenant,
                        at=now,
                        stage="queued",
                        reason=f"deadline passed while sharing the call of {leader}",
                    )
                )
                return
            copy = msgspec.structs.replace(
                outcome, request_id=follower, tenant=tenant, at=now, cost=0.0, shared_with=leader
            )
            if outcome.text:
                chunk = TokenChunk(request_id=follower, seq=0, text=outcome.text)
                await self._js.publish(
                    token_subject(tenant, follower),
                    encode(chunk),
                    headers={"Nats-Msg-Id": msg_id(tenant, follower, "shared")},
                )
            await self._log.finish(copy, seq=1 if outcome.text else 0)
        elif (
            isinstance(outcome, Failed)
            and outcome.backend is not None
            and (outcome.error_type != "undeliverable")
        ):
            await self._log.finish(
                Failed(
                    request_id=follower,
                    tenant=tenant,
                    at=now,
                    error_type="shared_call_failed",
                    reason=f"the call shared with {leader} failed: {outcome.error_type}",
                    backend=outcome.backend,
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
                Failed(
                    request_id=follower,
                    tenant=tenant,
                    at=self._clock(),
                    error_type=f"shared_call_{kind}",
                    reason=f"the call shared with {leader} ended {kind}",
                )
            )
            return
        again = msgspec.structs.replace(request, requeues=request.requeues + 1)
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
        subject = event_subject(tenant, request_id, "submitted")
        try:
            raw = await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
            event = EVENT_DECODER.decode(raw.data or b"")
        except (NotFoundError, msgspec.DecodeError):
            return None
        if not isinstance(event, Submitted) or event.request.id != request_id:
            return None
        return event.request

    # ------------------------------------------------------ follower's own end

    async def follower_cancelled(self, tenant: str, request_id: str) -> bool:
        """End a coalesced follower that was cancelled; False if it is no follower.

        Reads the request's ``coalesced`` and ``submitted`` events (a follower
        is held by no router, so the log is where it is found).
        """
        subject = event_subject(tenant, request_id, "coalesced")
        try:
            await self._js.get_last_msg(EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return False
        await self._log.finish(
            Cancelled(
                request_id=request_id,
                tenant=tenant,
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
            Expired(
                request_id=request.id,
                tenant=request.tenant,
                at=self._clock(),
                stage="queued",
                reason="deadline passed while sharing another request's call",
            )
        )
        await self.leave(request.tenant, key, request.id)
