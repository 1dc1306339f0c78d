"""A new binder's wait for its view of the projection to catch up with the log.

A binder that takes over (or starts after a restart) binds nothing to a
backend its ledger judges (limits declared or reported, a pause) before it
knows what its predecessor spent there: until its view of the projection
covers the log as it stood when the term began (:meth:`CatchUp.begin`),
:meth:`CatchUp.pending` says so each round. Binds to other backends go on
meanwhile.

It waits while the view moves. When it has not moved for ``_CATCH_UP_STALL``
seconds, the stored projection is read directly (its progress, then each
backend's view: the watch may be stale), and if that has not moved either, no
projector is writing: it binds on what it knows (logged). It waits
``_CATCH_UP_LIMIT`` seconds at most in all (logged). A view that never had a
projection written (no progress mark read: a new deployment, or routers that
have never had a projector) is not waited for.
"""

from __future__ import annotations

import asyncio
from typing import Final

from ...config import Config
from ...coordination import StateView
from ...errors import RenQueueError
from ...logs import get_logger

__all__ = ["CatchUp"]

log = get_logger("router")

#: Seconds without a move of a new binder's view of the projection, while it
#: lags the log as the term began, before the binder reads the stored progress
#: itself (the watch may be stale: StateView notices that only after up to two
#: of its ``check_every``); if that has not moved either, no projector is
#: writing: it binds on what it knows (logged).
_CATCH_UP_STALL: Final = 3.0
#: Seconds a new binder holds binds to the backends its ledger judges, at most,
#: waiting for its view to catch up (a projector refolding a long backlog):
#: past that it binds on what it knows (logged).
_CATCH_UP_LIMIT: Final = 10.0


class CatchUp:
    """One term's wait for its view of the projection (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        #: While a new term's view of the projection lags the log as it stood
        #: when the term began: (that log sequence, the view's sequence last
        #: seen, when it last moved, when the term began: loop time). Nothing
        #: is bound meanwhile to a backend the ledger judges.
        self._mark: tuple[int, int, float, float] | None = None

    def begin(self, logged: int) -> None:
        """A term begins; the log's last sequence is ``logged``."""
        began = asyncio.get_running_loop().time()
        self._mark = (logged, -1, began, began)

    def end(self) -> None:
        """The term ended: nothing to wait for."""
        self._mark = None

    async def pending(self, state: StateView | None) -> bool:
        """Whether this term still waits for its view of the projection to
        cover the log as it stood when the term began (may await a read of
        the stored projection)."""
        if self._mark is not None and await self._over(state, *self._mark):
            self._mark = None
        return self._mark is not None

    async def _over(
        self, state: StateView | None, target: int, seen: int, moved: float, began: float
    ) -> bool:
        """One look at the catch-up (see :meth:`pending`): True once it is over."""
        if state is None or state.revision == 0 or state.state.last_seq >= target:
            return True
        loop = asyncio.get_running_loop()
        now = loop.time()
        folded = state.state.last_seq
        if now - began >= _CATCH_UP_LIMIT:
            log.warning(
                "the projection did not catch up with the log in time; binding on what it knows",
                folded=folded,
                logged=target,
                waited=round(now - began, 1),
            )
            return True
        if folded == seen and now - moved >= _CATCH_UP_STALL:
            try:
                await state.refresh(self._config.backends)
            except RenQueueError as exc:  # read again next round
                log.warning("could not read the stored projection", error=str(exc))
                return False
            folded = state.state.last_seq
            if folded == seen:
                log.warning(
                    "the projection lags the log and does not move; binding on what it knows",
                    folded=folded,
                    logged=target,
                )
                return True
        if folded != seen:
            self._mark = (target, folded, loop.time(), began)
        return folded >= target
