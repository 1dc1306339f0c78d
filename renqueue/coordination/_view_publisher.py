"""The projector's views: one small KV entry per backend, tenant and A/B split.

:class:`ViewPublisher` writes the views a fold stored as the checkpoint
differs in from what it last wrote, then the progress mark. Readers
(:class:`~._view.StateView`) read the views, not the whole checkpoint.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Final

import msgspec

from ..broker import KeyValue
from ..logs import get_logger
from ..state import BackendState, ProjectionState, SplitState
from ._view import (
    PROGRESS_KEY,
    BackendView,
    Progress,
    SplitView,
    TenantSpend,
    TenantView,
    backend_view_key,
    decode_progress,
    encode_view,
    split_view_key,
    tenant_view_key,
)

__all__ = ["ViewPublisher"]

log = get_logger("projection")

#: A backend name that can be a KV key (config's names are all of this shape).
_VIEW_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ViewPublisher:
    """Publishes the views of the backends, tenants and A/B splits that differ
    from what it last published, then the state's progress.

    Called only for a state stored as the checkpoint, so a view never runs
    ahead of the checkpoint. The progress mark goes last: a reader that
    sees it has every view written for the fold up to its sequence. A view
    that fails to be written is written again at the next flush (what this
    publisher has published moves only on success); a projector that
    starts publishes every backend anew (repairing a damaged or deleted
    view), and one that adopts another's checkpoint publishes what differs
    from its own last views (no checkpoint write: two projectors never
    trade writes over an idle log). Every ``republish_every`` seconds all
    views are written again, so one deleted, damaged or overwritten by a
    slower projector's older write is repaired within that time.

    A fold still behind the views stored for this log (a refold from the
    start) publishes nothing: they stand until it passes them. A backend
    whose name cannot be a KV key (only a broken or forged event could
    name one) is folded but never published, and counted in
    :attr:`views_skipped`.
    """

    def __init__(self, *, clock: Callable[[], float], republish_every: float) -> None:
        self._clock = clock
        self._republish_every = republish_every
        self._kv: KeyValue | None = None
        #: The events stream's creation time: what the views' sequences count in.
        self._epoch = ""
        #: Each backend's state as last published in its view (by identity: a
        #: fold replaces a backend's state when it changes it).
        self._published: dict[str, BackendState] = {}
        self._published_spends: dict[str, TenantSpend] = {}
        #: Each A/B split's state as last published in its view (the same way).
        self._published_splits: dict[str, SplitState] = {}
        #: The sequence the published views reflect (behind the checkpoint
        #: only after a failed view write: the next flush writes them).
        self._views_seq = 0
        #: Views stored by an earlier fold of this log up to here stand until
        #: this fold passes it (a refold from the start publishes nothing older).
        self._views_floor = 0
        self._last_full_publish = -math.inf
        #: Names that cannot be a KV key: folded, never published.
        self.views_skipped = 0
        self._unpublishable: set[str] = set()

    def open(self, kv: KeyValue, epoch: str) -> None:
        """Publish into ``kv``, for the events stream created at ``epoch``."""
        self._kv = kv
        self._epoch = epoch

    @property
    def _bucket(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("the projector is not started")
        return self._kv

    async def reset(self) -> None:
        """Forget what was published: every view is published anew at the next
        flush (the bucket may have been made again), but none while the fold is
        behind the views already stored for this log."""
        self._views_seq = 0
        self._published = {}
        self._published_spends = {}
        self._published_splits = {}
        self._views_floor = await self._stored_views_seq()

    async def _stored_views_seq(self) -> int:
        """The sequence of the stored views, if they count in this log's sequences."""
        entry = await self._bucket.latest(PROGRESS_KEY)
        if entry is None or entry.operation is not None:
            return 0
        try:
            progress = decode_progress(entry.value)
        except msgspec.DecodeError:
            return 0
        return progress.last_seq if progress.epoch == self._epoch else 0

    def behind(self, stored_seq: int) -> bool:
        """Whether the views are behind the checkpoint at ``stored_seq`` (a view
        write failed, or none was published since the state was loaded), or
        every view is due to be written again."""
        return (
            self._views_seq < stored_seq
            or self._clock() - self._last_full_publish >= self._republish_every
        )

    def due_in(self) -> float:
        """Seconds until every view is due to be written again (0 or less: due now)."""
        return self._last_full_publish + self._republish_every - self._clock()

    def _skip(self, kind: str, name: str) -> bool:
        """Whether ``name`` cannot be a view key (then counted and logged, once)."""
        if _VIEW_NAME.fullmatch(name):
            return False
        if name not in self._unpublishable:
            self._unpublishable.add(name)
            self.views_skipped += 1
            log.warning(f"{kind} name cannot be a view key; not published", **{kind: name})
        return True

    def _changed_backends(self, state: ProjectionState) -> dict[str, BackendState]:
        published = self._published
        changed: dict[str, BackendState] = {}
        for name, backend in state.backends.items():
            if (previous := published.get(name)) is backend or previous == backend:
                continue
            if self._skip("backend", name):
                continue
            changed[name] = backend
        return changed

    def _changed_spends(self, state: ProjectionState) -> dict[str, TenantSpend]:
        """The tenants whose day's spend or committed cost differs from what
        was last published: only a paid call moves a tenant's view, so a free
        call writes none."""
        changed: dict[str, TenantSpend] = {}
        for name, tenant in state.tenants.items():
            if tenant.spend <= 0 and tenant.committed <= 0:  # nothing to budget
                continue
            spend = TenantSpend(
                day=tenant.day, day_spend=tenant.day_spend, committed=tenant.committed
            )
            if self._published_spends.get(name) == spend:
                continue
            if self._skip("tenant", name):
                continue
            changed[name] = spend
        return changed

    def _changed_splits(self, state: ProjectionState) -> dict[str, SplitState]:
        """The A/B splits whose state or figures differ from what was last published."""
        published = self._published_splits
        return {
            name: split
            for name, split in state.splits.routes.items()
            if (previous := published.get(name)) is not split
            and previous != split
            and _VIEW_NAME.fullmatch(name)
        }

    async def publish(self, state: ProjectionState) -> None:
        """Publish what differs in ``state`` (stored as the checkpoint), then its progress."""
        if state.last_seq < self._views_floor:
            self._views_seq = state.last_seq
            return
        now = self._clock()
        full = now - self._last_full_publish >= self._republish_every
        if full:
            self._published = {}
            self._published_spends = {}
            self._published_splits = {}
        changed = self._changed_backends(state)
        spends = self._changed_spends(state)
        splits = self._changed_splits(state)
        kv = self._bucket
        seq, epoch = state.last_seq, self._epoch
        if changed or spends or splits:
            await asyncio.gather(
                *(
                    kv.put(
                        backend_view_key(name),
                        encode_view(BackendView(last_seq=seq, epoch=epoch, backend=backend)),
                    )
                    for name, backend in changed.items()
                ),
                *(
                    kv.put(
                        tenant_view_key(name),
                        encode_view(TenantView(last_seq=seq, epoch=epoch, tenant=spend)),
                    )
                    for name, spend in spends.items()
                ),
                *(
                    kv.put(
                        split_view_key(name),
                        encode_view(SplitView(last_seq=seq, epoch=epoch, split=split)),
                    )
                    for name, split in splits.items()
                ),
            )
            self._published.update(changed)
            self._published_spends.update(spends)
            self._published_splits.update(splits)
        progress = Progress(last_seq=seq, epoch=epoch, log_time=state.log_time)
        await kv.put(PROGRESS_KEY, encode_view(progress))
        self._views_seq = state.last_seq
        if full:
            self._last_full_publish = now
