"""Coalescing: identical requests of one tenant share one backend call.

Requests are identical when they carry the same ``dedupe_key``, or, when they
ask for it (``coalesce=True``), the same route, messages and parameters. The
first one a router reads becomes the group's *leader* and is routed as usual;
the others become *followers*: a ``coalesced`` event, and they leave the queue.
When the leader's call ends, its worker closes the group (no one joins after
that) and gives every follower a copy of the outcome: the same text as one
token chunk and a ``completed`` event with ``shared_with`` set and no cost
(the spend is the leader's); or, if the shared call did not complete, a
``failed`` event saying so. A request that arrives after the group closed
starts a new one.

The group lives in the ``rq-state`` KV bucket under ``co.<tenant>.<key>``,
changed only by compare-and-set, so any number of routers and workers agree
on who leads and who follows.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Final

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from .messages import InferenceRequest
from .subjects import STATE_BUCKET

__all__ = ["Group", "Groups", "coalesce_key"]

_TRIES: Final = 8


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


_DECODER: Final = msgspec.json.Decoder(Group)


class Groups:
    """Joining and closing coalescing groups in the KV bucket."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await self._js.key_value(STATE_BUCKET)
        return self._kv

    @staticmethod
    def _key(request: InferenceRequest, key: str) -> str:
        return f"co.{request.tenant}.{key}"

    async def join(self, request: InferenceRequest, key: str) -> str | None:
        """Join ``request``'s group: ``None`` if it leads, else the leader's id."""
        kv = await self._bucket()
        name = self._key(request, key)
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
            if request.id in group.followers:
                return group.leader  # a redelivery of a follower
            changed = (
                Group(leader=request.id)
                if group.closed
                else Group(leader=group.leader, followers=[*group.followers, request.id])
            )
            try:
                await kv.update(name, msgspec.json.encode(changed), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return None if group.closed else group.leader
        raise RuntimeError(f"could not join coalescing group {name} after {_TRIES} tries")

    async def close(self, request: InferenceRequest, key: str) -> list[str]:
        """Close the group ``request`` leads; its followers. Idempotent."""
        kv = await self._bucket()
        name = self._key(request, key)
        for _ in range(_TRIES):
            try:
                entry = await kv.get(name)
            except KeyNotFoundError:
                return []
            group = _DECODER.decode(entry.value)
            if group.leader != request.id:
                return []  # not (or no longer) the leader: nothing to hand out
            if group.closed:
                return group.followers
            closed = Group(leader=group.leader, followers=group.followers, closed=True)
            try:
                await kv.update(name, msgspec.json.encode(closed), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return group.followers
        raise RuntimeError(f"could not close coalescing group {name} after {_TRIES} tries")

    async def forget(self, request: InferenceRequest, key: str) -> None:
        """Drop a closed group once its followers have their outcomes."""
        kv = await self._bucket()
        try:
            entry = await kv.get(self._key(request, key))
        except KeyNotFoundError:
            return
        if _DECODER.decode(entry.value).leader == request.id:
            with contextlib.suppress(KeyWrongLastSequenceError):
                await kv.delete(self._key(request, key), last=entry.revision)
