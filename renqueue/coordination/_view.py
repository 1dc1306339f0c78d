"""The state view: a reader's live copy of the projection's per-backend keys.

Readers (routers) need each backend's state (health, durations, quota) and how
far the log is folded, not the whole projection: the projector publishes, after
each write of its checkpoint (the key ``projection``), one key per backend
whose state changed (``view.backend.<name>``: :class:`BackendView`), one per
A/B split whose state changed (``view.split.<route>``: :class:`SplitView`),
and then ``view.progress`` (:class:`Progress`: the sequence and log time the
views reflect). :class:`StateView` watches ``view.>`` and keeps :class:`LiveState`,
so a reader decodes only what changed, never the whole projection.

A watch that ends or goes quiet while the stored progress moved on is
re-opened from the current values; one that cannot be re-opened fails its
loop (and, persisting, its process: see :mod:`renqueue.tasks`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Final, Self

import msgspec
from msgspec import Struct

from ..broker import JetStream, KeyEntry, KeyValue, KeyWatcher
from ..errors import NatsError, NatsTimeoutError
from ..lifecycle import Lifecycle, State
from ..logs import get_logger
from ..policy import DEFAULT_COOLDOWN, DEFAULT_FAILURE_THRESHOLD, is_healthy
from ..schema import STATE_BUCKET
from ..state import EMPTY_BACKEND, STATE_VERSION, BackendState, SplitState
from ..tasks import Supervisor

__all__ = [
    "PROGRESS_KEY",
    "VIEW_KEYS",
    "BackendView",
    "LiveState",
    "Progress",
    "SplitView",
    "StateView",
    "TenantSpend",
    "TenantView",
    "backend_view_key",
    "decode_backend_view",
    "decode_progress",
    "decode_split_view",
    "decode_tenant_view",
    "encode_view",
    "split_view_key",
    "tenant_view_key",
]

log = get_logger("projection")

#: The keys the views live under (a KV watch filter): ``view.backend.<name>``,
#: ``view.tenant.<name>``, ``view.split.<route>`` and ``view.progress``.
VIEW_KEYS: Final = "view.>"
#: How far the views reflect the log; written after the backends' views.
PROGRESS_KEY: Final = "view.progress"
_BACKEND_PREFIX: Final = "view.backend."
_TENANT_PREFIX: Final = "view.tenant."
_SPLIT_PREFIX: Final = "view.split."


def backend_view_key(name: str) -> str:
    """The KV key of backend ``name``'s view (backend names are key-safe: config checks)."""
    return _BACKEND_PREFIX + name


def tenant_view_key(name: str) -> str:
    """The KV key of tenant ``name``'s spend view (tenant names are key-safe: subject tokens)."""
    return _TENANT_PREFIX + name


class TenantSpend(Struct, frozen=True, kw_only=True):
    """What a tenant spent (USD) on its latest UTC day with any spend
    (``day``: days since 1970-01-01, of event time)."""

    day: int = 0
    day_spend: float = 0.0
    #: The estimated cost of its calls bound and not ended (``TenantState.committed``).
    committed: float = 0.0

    def spend_on(self, day: int) -> float:
        """Its spend on UTC day ``day``: 0 unless it is the latest."""
        return self.day_spend if day == self.day else 0.0


def split_view_key(route: str) -> str:
    """The KV key of the view of route ``route``'s A/B split."""
    return _SPLIT_PREFIX + route


class SplitView(Struct, frozen=True, kw_only=True):
    """One A/B split's state as of the log's sequence ``last_seq`` (see :class:`BackendView`)."""

    v: int = STATE_VERSION
    last_seq: int
    split: SplitState
    epoch: str = ""


class TenantView(Struct, frozen=True, kw_only=True):
    """One tenant's spend as of the log's sequence ``last_seq`` (see :class:`BackendView`)."""

    v: int = STATE_VERSION
    last_seq: int
    tenant: TenantSpend
    epoch: str = ""


class BackendView(Struct, frozen=True, kw_only=True):
    """One backend's state as of the log's sequence ``last_seq``.

    ``epoch`` names the log the sequence counts in (the events stream's
    creation time): a reader holding a later view of the same epoch keeps it.
    """

    v: int = STATE_VERSION
    last_seq: int
    backend: BackendState
    epoch: str = ""


class Progress(Struct, frozen=True, kw_only=True):
    """How far the views are folded: every backend view written for a fold up
    to ``last_seq`` is stored before this. ``log_time`` is the projection's clock."""

    v: int = STATE_VERSION
    last_seq: int
    log_time: float
    epoch: str = ""


class LiveState(Struct, frozen=True, kw_only=True):
    """What a reader holds: each backend's state, each tenant's spend, and how
    far the log is folded.

    A backend the log never named has an empty state (healthy, no quota used);
    a tenant that never spent has spent nothing. Per-tenant counters,
    in-flight requests and reservations are in the projector's checkpoint
    (:class:`~renqueue.state.ProjectionState`), which readers do not decode.
    """

    last_seq: int = 0
    log_time: float = 0.0
    backends: dict[str, BackendState] = {}
    tenants: dict[str, TenantSpend] = {}
    #: Each A/B split's state and per-arm figures, by route.
    splits: dict[str, SplitState] = {}

    def backend(self, name: str) -> BackendState:
        """The state of ``name``; a backend the log never mentioned has an empty one."""
        return self.backends.get(name, EMPTY_BACKEND)

    def spent(self, tenant: str, day: int) -> float:
        """What ``tenant`` spent (USD) on UTC day ``day`` (:func:`~renqueue.state.utc_day`)."""
        spend = self.tenants.get(tenant)
        return 0.0 if spend is None else spend.spend_on(day)

    def committed(self, tenant: str) -> float:
        """The estimated cost (USD) of ``tenant``'s calls bound and not ended."""
        spend = self.tenants.get(tenant)
        return 0.0 if spend is None else spend.committed


_ENCODER: Final = msgspec.json.Encoder()
_BACKEND_VIEW_DECODER: Final = msgspec.json.Decoder(BackendView)
_TENANT_VIEW_DECODER: Final = msgspec.json.Decoder(TenantView)
_SPLIT_VIEW_DECODER: Final = msgspec.json.Decoder(SplitView)
_PROGRESS_DECODER: Final = msgspec.json.Decoder(Progress)


def encode_view(view: BackendView | TenantView | SplitView | Progress) -> bytes:
    return _ENCODER.encode(view)


def decode_backend_view(data: bytes) -> BackendView:
    """Raises ``msgspec.DecodeError`` if ``data`` is not a backend view."""
    return _BACKEND_VIEW_DECODER.decode(data)


def decode_tenant_view(data: bytes) -> TenantView:
    """Raises ``msgspec.DecodeError`` if ``data`` is not a tenant view."""
    return _TENANT_VIEW_DECODER.decode(data)


def decode_split_view(data: bytes) -> SplitView:
    """Raises ``msgspec.DecodeError`` if ``data`` is not a split's view."""
    return _SPLIT_VIEW_DECODER.decode(data)


def decode_progress(data: bytes) -> Progress:
    """Raises ``msgspec.DecodeError`` if ``data`` is not a progress mark."""
    return _PROGRESS_DECODER.decode(data)


# ----------------------------------------------------------------- state view


class StateView(Lifecycle):
    """The latest per-backend views, kept current by a KV watch of ``view.>``.

    Open with ``await StateView.open(js)``; close with :meth:`close` (or use it
    as an async context manager). Until a projector has written anything the
    state is empty, and every backend is healthy. :attr:`state` is a
    :class:`LiveState`, replaced (never changed) on each update.

    The watch is followed by a loop under ``supervisor`` (the process's; a
    private one if not given). A watch can end or go quiet while the stored
    value moves on (its consumer lost with a server restart, the bucket
    re-created with sequences starting over): whenever the watch has been
    silent for ``check_every`` seconds, the view reads the stored progress,
    and if the watch has still not delivered it at the next check, the watch
    is re-opened from the current value (logged). A watch that cannot be
    re-opened fails the loop: the supervisor logs it and retries with
    backoff, and a view that stays blind takes its process down.
    """

    def __init__(
        self,
        js: JetStream,
        *,
        threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown: float = DEFAULT_COOLDOWN,
        supervisor: Supervisor | None = None,
        name: str = "state-view",
        check_every: float = 5.0,
    ) -> None:
        self._js = js
        self._name = name
        self.threshold = threshold
        self.cooldown = cooldown
        self.state = LiveState()
        #: The revision of the latest progress mark taken.
        self.revision = 0
        #: Times the watch was found ended or stale and re-opened.
        self.reopened = 0
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor if supervisor is not None else Supervisor(name)
        self._loop = f"{name}-watch"
        self._check_every = check_every
        self._kv: KeyValue | None = None
        self._watcher: KeyWatcher | None = None
        #: The last progress entry the watch delivered: (revision, value).
        self._watch_rev = 0
        self._watch_value = b""
        self._behind = False
        self._broken = False
        self._changed = asyncio.Event()
        #: The epoch of the progress mark held, and of each view (by key) with its sequence.
        self._epoch = ""
        self._seqs: dict[str, tuple[str, int]] = {}

    @classmethod
    async def open(
        cls,
        js: JetStream,
        *,
        threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown: float = DEFAULT_COOLDOWN,
        supervisor: Supervisor | None = None,
        name: str = "state-view",
        check_every: float = 5.0,
    ) -> StateView:
        """Watch the stored state; returns once the current value (if any) is loaded."""
        view = cls(
            js,
            threshold=threshold,
            cooldown=cooldown,
            supervisor=supervisor,
            name=name,
            check_every=check_every,
        )
        await view.start()
        return view

    async def __aenter__(self) -> Self:
        """Start the view, unless :meth:`open` already has.

        So both ``async with StateView(js)`` and ``async with await StateView.open(js)`` work.
        """
        if self.status is not State.RUNNING:
            await self.start()
        return self

    async def _start(self) -> None:
        await self._open_watch()
        self._supervisor.spawn(self._loop, self._follow)

    def expected_duration(self, name: str, *, min_samples: int = 5) -> float | None:
        """What a call to ``name`` is expected to take; ``None`` until it has
        ``min_samples`` completions (an estimate from fewer is noise)."""
        backend = self.state.backends.get(name)
        if backend is None or backend.calls_completed < min_samples:
            return None
        return backend.duration_ewma

    def backend_healthy(self, name: str, now: float) -> bool:
        """:func:`is_healthy` for ``name`` at Unix time ``now``; unknown backends are healthy."""
        backend = self.state.backends.get(name)
        if backend is None:
            return True
        return is_healthy(backend, now, threshold=self.threshold, cooldown=self.cooldown)

    async def wait_for(self, seq: int) -> LiveState:
        """Wait until the view reflects stream sequence ``seq`` or later.

        Bound the wait with ``asyncio.timeout``.
        """
        while self.state.last_seq < seq:
            self._changed.clear()
            await self._changed.wait()
        return self.state

    async def refresh(self, backends: Iterable[str], tenants: Iterable[str] = ()) -> None:
        """Read the stored views directly, not through the watch: the progress
        mark, then each of ``backends``' views, and take what is newer than
        what is held.

        For a reader that must not trust a watch that may be stale (it is
        re-opened only after up to two ``check_every`` of silence). The
        progress is read first: the projector writes it after the views, so
        the views read after it are at least as new as it says.
        """
        if self._kv is None:
            return
        progress = await self._kv.latest(PROGRESS_KEY)
        keys = [*map(backend_view_key, backends), *map(tenant_view_key, tenants)]
        views = [await self._kv.latest(key) for key in keys]
        for entry in (*views, progress):
            if entry is not None:
                self._take(entry)

    async def _close(self) -> None:
        await self._supervisor.cancel(self._loop)
        if self._own_supervisor:
            await self._supervisor.close()
        await self._close_watch()

    def _take(self, entry: KeyEntry) -> None:
        """Take a watched entry, unless it is older than what is held.

        Views only move forward within an epoch (one events stream): a view
        or progress mark of a lower sequence (a slower projector's late write,
        a refold from the start) is ignored. A delete marker keeps what is
        held (the projector writes every view again within its
        ``republish_every``). A new epoch (the events stream made again)
        starts over: what is held of the old one is dropped. An entry that
        does not decode is logged and ignored.
        """
        if entry.operation is not None or not entry.key.startswith("view."):
            return
        key = entry.key
        try:
            if key == PROGRESS_KEY:
                taken = self._take_progress(decode_progress(entry.value), entry.revision)
            elif key.startswith(_BACKEND_PREFIX):
                view = decode_backend_view(entry.value)
                taken = self._newer(key, view.epoch, view.last_seq)
                if taken:
                    backends = {**self.state.backends, key[len(_BACKEND_PREFIX) :]: view.backend}
                    self.state = msgspec.structs.replace(self.state, backends=backends)
            elif key.startswith(_TENANT_PREFIX):
                spend = decode_tenant_view(entry.value)
                taken = self._newer(key, spend.epoch, spend.last_seq)
                if taken:
                    tenants = {**self.state.tenants, key[len(_TENANT_PREFIX) :]: spend.tenant}
                    self.state = msgspec.structs.replace(self.state, tenants=tenants)
            elif key.startswith(_SPLIT_PREFIX):
                split = decode_split_view(entry.value)
                taken = self._newer(key, split.epoch, split.last_seq)
                if taken:
                    splits = {**self.state.splits, key[len(_SPLIT_PREFIX) :]: split.split}
                    self.state = msgspec.structs.replace(self.state, splits=splits)
            else:
                return
        except msgspec.DecodeError as exc:
            log.warning("undecodable projection view in KV ignored", key=key, error=str(exc))
            return
        if taken:
            self._changed.set()

    def _take_progress(self, progress: Progress, revision: int) -> bool:
        """Take a progress mark unless it is older than the one held (see :meth:`_take`)."""
        state = self.state
        if progress.epoch == self._epoch and progress.last_seq < state.last_seq:
            return False
        if progress.epoch != self._epoch:
            self._epoch = progress.epoch
            current = {key for key, (epoch, _) in self._seqs.items() if epoch == progress.epoch}
            self._seqs = {key: self._seqs[key] for key in current}
            state = msgspec.structs.replace(
                state,
                backends={
                    name: backend
                    for name, backend in state.backends.items()
                    if backend_view_key(name) in current
                },
                tenants={
                    name: spend
                    for name, spend in state.tenants.items()
                    if tenant_view_key(name) in current
                },
                splits={
                    name: split
                    for name, split in state.splits.items()
                    if split_view_key(name) in current
                },
            )
        self.revision = revision
        self.state = msgspec.structs.replace(
            state, last_seq=progress.last_seq, log_time=progress.log_time
        )
        return True

    def _newer(self, key: str, epoch: str, seq: int) -> bool:
        """Whether a view under ``key`` of ``epoch`` at ``seq`` is to be taken
        (not older than the one held of the same epoch); if so, it is held."""
        held = self._seqs.get(key)
        if held is not None and held[0] == epoch and seq < held[1]:
            return False
        self._seqs[key] = (epoch, seq)
        return True

    def _seen(self, entry: KeyEntry) -> None:
        """An entry (value or marker) the watch delivered."""
        if entry.key == PROGRESS_KEY:
            self._watch_rev = entry.revision
            self._watch_value = entry.value
            self._behind = False
        self._take(entry)

    async def _open_watch(self) -> KeyWatcher:
        """Open a watch and load the current value (the watch delivers it, then None).

        nats-py may put its "no more values" marker ahead of values already
        on their way (it asks the consumer how many are pending, and counts
        those its subscription has taken: a value in between is neither), so
        the watch is read on until it has delivered the progress stored now.
        """
        self._kv = await self._js.key_value(STATE_BUCKET)
        # What an earlier watch saw says nothing of this one's (a bucket made
        # again counts its revisions from 1).
        self._watch_rev, self._watch_value = 0, b""
        self._watcher = watcher = await self._kv.watch(VIEW_KEYS)
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            self._seen(entry)
        stored, _ = await self._stored()
        while self._watch_rev < stored:
            if (entry := await watcher.updates(timeout=5.0)) is not None:
                self._seen(entry)
        self._behind = False
        self._broken = False
        return watcher

    async def _close_watch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(NatsError):
                await watcher.close()

    async def _reopen(self, why: str) -> KeyWatcher:
        log.warning("projection watch re-opened", reason=why, revision=self._watch_rev)
        self.reopened += 1
        await self._close_watch()
        return await self._open_watch()

    async def _stored(self) -> tuple[int, bytes]:
        """The stored progress (or its delete marker): (revision, value); (0, b"") if none."""
        if self._kv is None:
            return 0, b""
        entry = await self._kv.latest(PROGRESS_KEY)
        return (0, b"") if entry is None else (entry.revision, entry.value)

    async def _stale(self) -> bool:
        """The watch was quiet for a while: has the stored value moved on without it?

        The stored entry is compared by revision *and* value: a bucket
        re-created (after a store was lost) counts revisions from 1 again, so
        a revision alone could match the watch's last one by chance. Stale
        only when an entry stored at the previous check has still not
        arrived, so a value on its way when the check ran is no false alarm.
        """
        if await self._stored() == (self._watch_rev, self._watch_value):
            self._behind = False
            return False
        was_behind, self._behind = self._behind, True
        return was_behind

    async def _follow(self) -> None:
        """Take each update; re-open the watch when it ended or went stale.

        An error (the bucket gone, the server unreachable) ends this run: the
        supervisor logs it and starts the loop again, which re-opens the watch.
        """
        try:
            watcher = self._watcher
            if self._broken or watcher is None:
                watcher = await self._reopen("the previous watch failed")
            while True:
                try:
                    entry = await watcher.updates(timeout=self._check_every)
                except NatsTimeoutError:
                    if await self._stale():
                        watcher = await self._reopen("silent while the stored value changed")
                    continue
                if entry is None:
                    continue
                if watcher.is_stop(entry):
                    watcher = await self._reopen("the watch ended")
                    continue
                self._seen(entry)
        except Exception:
            self._broken = True
            raise
