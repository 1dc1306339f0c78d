"""What the router's stages share: :class:`Parts`, built once by the router.

The term (``_term``), the intake (``_intake``) and the round (``_round``) are
stages of one router: they read and write the same hold, lease and books.
Each is given them here, rather than reaching into another stage.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from ...broker import Connection, EventLog, JetStream
from ...config import Config
from ...coordination import Lease, LiveState, StateView
from ._endings import Endings
from ._hold import Hold
from ._inflight import Inflight
from ._ledger import Ledger
from ._placement import Placement
from ._spending import Spending

__all__ = ["Parts"]


@dataclasses.dataclass(kw_only=True, eq=False)
class Parts:
    """What the router's stages share (see the module docstring)."""

    nc: Connection
    js: JetStream
    config: Config
    clock: Callable[[], float]
    #: The event log: ``submitted``, the decisions, the endings.
    log: EventLog
    #: The binder's lease: only its holder fetches and binds.
    lease: Lease
    #: The requests fetched and waiting to be bound.
    hold: Hold
    #: Each backend's quota as the binder reserves it, and its pauses.
    ledger: Ledger
    #: Each request's A/B arm and complexity tier.
    placement: Placement
    #: What each tenant with a hard daily budget has spent.
    spending: Spending
    #: How a request ends here (expired, cancelled, rejected).
    endings: Endings
    #: The decisions' publishes under way.
    inflight: Inflight
    #: Set when a round may bind more: a slot freed, a request read or boosted.
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Set while the dispatch loop runs: nothing is fetched while it is down.
    dispatching: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: This router's view of the projection (opened as the router starts).
    view: StateView | None = None

    def live(self) -> LiveState | None:
        """What this router knows of the projection, if it has a view open."""
        return None if self.view is None else self.view.state
