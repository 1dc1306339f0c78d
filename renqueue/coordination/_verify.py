"""Checking the live projection against the log: what ``renqueue replay --verify`` does.

:func:`verify` reads the projector's checkpoint (the key ``projection`` in
``rq-state``), rebuilds the projection from the first event up to the
checkpoint's ``last_seq`` (the log may have moved on since), and compares the
two field by field (:func:`~renqueue.state.diff_states`). When the views are
at the checkpoint's sequence (``view.progress``), each backend's view
(``view.backend.<name>``) is compared with the rebuilt backend too, so a view
that disagrees with the log is named whether or not the checkpoint does.

While a projector flushes, it writes the checkpoint, then the views, then the
progress mark: a read that finds the progress behind the checkpoint, or sees
either move while the views are read, reads again a few times before it
reports the views as not compared.

A comparison is only made with a complete replay: the log must still hold
every event from sequence 1 to the checkpoint's (events older than
``RQ_EVENTS``' ``max_age`` expire, a purge removes some or all), and the
replay must reach the checkpoint's sequence (:func:`rebuild` ends early when
no event comes for 2 s: a server too slow to answer). Otherwise
:func:`verify` raises :class:`~renqueue.errors.RenQueueError` saying which,
rather than report as different what it could not check.
"""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec
from msgspec import Struct

from ..broker import JetStream, JetStreamApi, KeyValue, reply_error
from ..errors import NatsNotFoundError, RenQueueError
from ..schema import EVENTS_STREAM, STATE_BUCKET
from ..state import (
    STATE_KEY,
    BackendState,
    Difference,
    ProjectionState,
    decode_state,
    diff_states,
    diff_values,
)
from ._projector import rebuild
from ._view import PROGRESS_KEY, Progress, decode_backend_view, decode_progress

__all__ = ["Replayed", "Verification", "read_checkpoint", "replay_log", "verify"]

#: Every event's subject (``rq.evt.<tenant>.<request id>.<kind>``).
_EVENTS_SUBJECTS: Final = "rq.evt.>"

_VIEW_PREFIX: Final = "view.backend."


class Verification(Struct, frozen=True, kw_only=True):
    """What :func:`verify` found.

    ``differences`` lists the checkpoint's against the rebuilt state (paths as
    in the state's JSON), then each backend view's against the rebuilt backend
    (paths ``view.backend.<name>.<field>``). ``views_compared`` is false when
    the views were not at the checkpoint's sequence (``progress_seq``, ``None``
    when no progress mark is stored); then only the checkpoint was compared.
    """

    last_seq: int
    events: int
    differences: tuple[Difference, ...]
    views_compared: bool
    views: int
    progress_seq: int | None

    @property
    def equal(self) -> bool:
        return not self.differences


async def read_checkpoint(kv: KeyValue) -> tuple[ProjectionState, int] | None:
    """The stored checkpoint and its revision; ``None`` if none is stored.

    Raises :class:`~renqueue.errors.RenQueueError` if it does not decode.
    """
    entry = await kv.latest(STATE_KEY)
    if entry is None or entry.operation is not None:
        return None
    try:
        return decode_state(entry.value), entry.revision
    except msgspec.DecodeError as exc:
        raise RenQueueError(
            f"the stored projection ({STATE_BUCKET}/{STATE_KEY}) does not decode: {exc} "
            "(written by another version, or damaged)"
        ) from exc


async def _progress(kv: KeyValue) -> tuple[Progress | None, int]:
    entry = await kv.latest(PROGRESS_KEY)
    if entry is None or entry.operation is not None:
        return None, 0 if entry is None else entry.revision
    try:
        return decode_progress(entry.value), entry.revision
    except msgspec.DecodeError:
        return None, entry.revision


async def _views(kv: KeyValue) -> dict[str, BackendState | str]:
    """Every stored backend view: its backend, or why it cannot be read."""
    views: dict[str, BackendState | str] = {}
    for key in await kv.keys():
        if not key.startswith(_VIEW_PREFIX):
            continue
        entry = await kv.latest(key)
        if entry is None or entry.operation is not None:
            continue
        try:
            views[key[len(_VIEW_PREFIX) :]] = decode_backend_view(entry.value).backend
        except msgspec.DecodeError as exc:
            views[key[len(_VIEW_PREFIX) :]] = f"undecodable: {exc}"
    return views


async def verify(js: JetStream, *, attempts: int = 10, pause: float = 0.1) -> Verification:
    """Compare the stored projection (and its views) with a rebuild from the log.

    Reads the checkpoint and the views up to ``attempts`` times, ``pause``
    seconds apart, until the views are at the checkpoint's sequence and
    neither moved while they were read. Raises
    :class:`~renqueue.errors.RenQueueError` if no checkpoint is stored or it
    does not decode, if the log no longer holds every event up to the
    checkpoint's sequence, or if the replay stopped before it; and
    :class:`~renqueue.errors.NatsError` if NATS fails.
    """
    kv = await js.key_value(STATE_BUCKET)
    views: dict[str, BackendState | str] | None = None
    progress: Progress | None = None
    for attempt in range(max(1, attempts)):
        read = await read_checkpoint(kv)
        if read is None:
            raise RenQueueError(
                f"no projection is stored ({STATE_BUCKET}/{STATE_KEY}): no projector has "
                "written one yet"
            )
        checkpoint, revision = read
        progress, progress_revision = await _progress(kv)
        if progress is not None and progress.last_seq == checkpoint.last_seq:
            candidate = await _views(kv)
            again = await read_checkpoint(kv)
            if (
                again is not None
                and again[1] == revision
                and (await _progress(kv))[1] == progress_revision
            ):
                views = candidate
                break
        if attempt + 1 < attempts:
            await asyncio.sleep(pause)  # the projector is mid-flush: read again
    await _holds_events_up_to(js, checkpoint.last_seq)
    rebuilt = await rebuild(js, upto=checkpoint.last_seq)
    if rebuilt.last_seq != checkpoint.last_seq:
        raise RenQueueError(_stopped(rebuilt.last_seq, checkpoint.last_seq, ": cannot verify"))
    differences = diff_states(checkpoint, rebuilt)
    if views is not None:
        differences.extend(_compare_views(views, rebuilt))
    return Verification(
        last_seq=checkpoint.last_seq,
        events=rebuilt.events,
        differences=tuple(differences),
        views_compared=views is not None,
        views=0 if views is None else len(views),
        progress_seq=None if progress is None else progress.last_seq,
    )


class Replayed(Struct, frozen=True, kw_only=True):
    """What :func:`replay_log` folded: the state, and what the log no longer holds."""

    state: ProjectionState
    #: The first sequence the log still holds (1 unless events expired or were purged).
    first_seq: int
    #: Events deleted after ``first_seq`` (a purge of some subjects).
    deleted: int


async def replay_log(js: JetStream) -> Replayed:
    """The log folded from its first event to its last now (``renqueue replay``).

    Raises :class:`~renqueue.errors.RenQueueError` if the replay stopped
    before the last event still stored.
    """
    info = await js.stream_info(EVENTS_STREAM)
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    state = await rebuild(js, upto=last)
    if state.last_seq < last:
        # Stopped early: past an end that was purged (nothing is stored after
        # where it stopped), or short of events still there.
        try:
            after = await js.get_msg(
                EVENTS_STREAM, seq=state.last_seq + 1, subject=_EVENTS_SUBJECTS, next=True
            )
        except NatsNotFoundError:
            after = None
        if after is not None and after.seq <= last:
            raise RenQueueError(_stopped(state.last_seq, last))
    return Replayed(state=state, first_seq=first, deleted=int(info.state.num_deleted or 0))


def _stopped(reached: int, target: int, verdict: str = "") -> str:
    return (
        f"replay stopped at {reached} of {target}{verdict} (no event came for 2 s: the server "
        "too slow to answer, or the events after it gone; try again)"
    )


async def _holds_events_up_to(js: JetStream, upto: int) -> None:
    """Raise unless ``RQ_EVENTS`` still holds every event from sequence 1 to ``upto``."""
    if upto <= 0:
        return
    info = await js.stream_info(EVENTS_STREAM)
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    gone = f"the log no longer holds events 1..{upto}: cannot verify"
    if first != 1:
        raise RenQueueError(
            f"{gone} ({EVENTS_STREAM} now starts at sequence {first}: events older than its "
            "max_age expire, and a purge removes them)"
        )
    if last < upto:
        raise RenQueueError(
            f"{gone} ({EVENTS_STREAM} ends at sequence {last}: it was made again since the "
            "projector wrote its checkpoint)"
        )
    if info.state.num_deleted:
        # A purge of some subjects leaves holes: were any of them folded?
        reply = await JetStreamApi(js).call(
            f"STREAM.INFO.{EVENTS_STREAM}", {"deleted_details": True}
        )
        error = reply_error(reply)
        if error is not None:
            raise RenQueueError(f"cannot read {EVENTS_STREAM}'s deleted events: {error[1]}")
        holes = sum(1 for seq in reply.get("state", {}).get("deleted") or () if seq <= upto)
        if holes:
            raise RenQueueError(f"{gone} ({holes} of them were purged)")


def _compare_views(
    views: dict[str, BackendState | str], rebuilt: ProjectionState
) -> list[Difference]:
    found: list[Difference] = []
    for name in sorted(views.keys() | rebuilt.backends.keys()):
        path = f"{_VIEW_PREFIX}{name}"
        view = views.get(name)
        backend = rebuilt.backends.get(name)
        if view is None:
            found.append(Difference(path=path, rebuilt=msgspec.to_builtins(backend)))
        elif isinstance(view, str):
            found.append(
                Difference(
                    path=path,
                    live=view,
                    rebuilt=msgspec.UNSET if backend is None else msgspec.to_builtins(backend),
                )
            )
        elif backend is None:
            found.append(Difference(path=path, live=msgspec.to_builtins(view)))
        else:
            found.extend(diff_values(view, backend, path))
    return found
