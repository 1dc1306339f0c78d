"""The router: binds waiting requests to backends, late, in priority order.

Requests wait in the priority subjects (``rq.req.<level>.<tenant>``), one
durable pull consumer per level. Exactly one router binds at a time: the
holder of the binder's lease. It is the one place that decides what is
committed to each backend, so the binding order is global, whatever number
of routers run; the others stand by. :class:`Router` is the loop that
composes its stages, each a module of its own:

- the term (``_term``): the binder's lease, and the term it binds in while it
  holds it: re-creating the router consumers, running the loops below, and
  the keepalive of held requests;
- the intake (``_intake``): one long-poll fetch loop per level, feeding a
  small local hold (``_hold``, bounded per level, so batch work can never
  crowd out a critical fetch); reading each request (``_admission``:
  validation, the wait measured in server time, the parent's priority), its
  tenant's budget (``_spending``), its A/B arm and tier (``_placement``,
  ``_splitter``), coalescing, and cancellations;
- the round (``_round``): a single dispatch loop that takes held requests
  highest level first, oldest first, and binds each to the first candidate of
  its route that is healthy, capable and has a free slot *now*; the free
  slots it counts per backend (``_capacity``), quota (``_ledger``), circuits
  (``_circuits``), carrying out a bind (``_dispatch``), its side of the
  preemption protocol (``_asking``), and a new term's catch-up with the log
  (``_catch_up``).

What the stages share (the hold, the lease, the books, how a request ends,
the decisions being published) is in one :class:`~._parts.Parts`.

Every loop (one fetch loop per level, the dispatch loop, the keepalive, the
lease and renewal loops, the projection watch) runs under the process's
:class:`~renqueue.tasks.Supervisor`: a failed JetStream call is logged and
the loop started again after a capped backoff, and a loop that keeps failing
takes the process down. Requests are kept alive only for loops that run: when
the dispatch loop fails, every held request is handed back (nak'ed), and
nothing is fetched until it runs again.

A request's dispatch is given up (``failed``, ``undeliverable``, with a
dead-letter copy) after ``router.max_deliver`` *failed dispatches* seen by a
router, not after that many deliveries: hand-backs (graceful restarts, a
failed dispatch loop) are deliveries too, and must not use up its budget. The
router consumers' own ``max_deliver`` is a backstop far above it
(:func:`renqueue.schema.router_max_deliveries`).

The decisions are plain functions in :mod:`renqueue.policy` (a round:
:func:`~renqueue.policy.plan`; admission: :func:`~renqueue.policy.validate`);
the stages are the loops around them that do the NATS work.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from ...broker import (
    Connection,
    EventLog,
    JetStream,
    Subscription,
    router_consumer_configs,
)
from ...config import Config, parse_duration
from ...coordination import CancelWatch, Coalescer, Lease, LiveState, StateView
from ...lifecycle import Lifecycle
from ...logs import get_logger
from ...schema import BINDER_LEASE, boost_subject, capacity_subject
from ...tasks import Supervisor
from ._dispatch import ACKS_TIMEOUT
from ._endings import Endings
from ._hold import Hold
from ._inflight import Inflight
from ._intake import UNTAKEABLE_AFTER, Intake
from ._ledger import Ledger
from ._parts import Parts
from ._placement import Placement
from ._round import Round
from ._spending import Spending
from ._term import Term, loop_name

__all__ = ["UNTAKEABLE_AFTER", "Router"]

log = get_logger("router")

#: How long a stop waits for decisions still being published (each is bounded
#: by ``ACKS_TIMEOUT`` already; this is the backstop).
_INFLIGHT_STOP_WAIT: Final = ACKS_TIMEOUT + 5.0


class Router(Lifecycle):
    """One router process's loop. Stateless: any number may run side by side."""

    def __init__(
        self,
        nc: Connection,
        js: JetStream,
        config: Config,
        *,
        name: str = "router",
        clock: Callable[[], float] = time.time,
        cancels: CancelWatch | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._config = config
        self._name = name
        self._cancels = cancels
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor if supervisor is not None else Supervisor(name)
        #: The router's own loops (the lease's and the renewals'), by supervisor name.
        self._loops: list[str] = []
        self._state: StateView | None = None
        self._subs: list[Subscription] = []
        #: Removes this router's cancel listener (set while it is registered).
        self._unlisten: Callable[[], None] | None = None
        #: The binder's lease: only its holder fetches and binds (see module doc).
        self._lease = Lease(
            js,
            BINDER_LEASE,
            holder=f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            ttl=parse_duration(config.router.lease_ttl),
        )
        events = EventLog(js)
        coalescer = Coalescer(js, clock=clock, ttl=parse_duration(config.router.coalesce_ttl))
        self._parts = Parts(
            nc=nc,
            js=js,
            config=config,
            clock=clock,
            log=events,
            lease=self._lease,
            hold=Hold(list(config.priorities), config.router.hold_limit),
            ledger=Ledger(config),
            placement=Placement(config),
            spending=Spending(config),
            endings=Endings(events, coalescer, clock=clock),
            inflight=Inflight(),
        )
        self._round = Round(self._parts)
        self._intake = Intake(
            self._parts,
            name=name,
            supervisor=self._supervisor,
            coalescer=coalescer,
            cancels=cancels,
        )
        self._term = Term(
            self._parts,
            name=name,
            supervisor=self._supervisor,
            intake=self._intake,
            round_=self._round,
        )

    @property
    def routed(self) -> int:
        """Requests this router bound (their decisions stored)."""
        return self._round.routed

    @property
    def rejected(self) -> int:
        """Requests this router rejected."""
        return self._parts.endings.rejected

    @property
    def projection(self) -> LiveState | None:
        """What this router knows of the projection (``None`` before it starts)."""
        return None if self._state is None else self._state.state

    @property
    def binding(self) -> bool:
        """Whether this router holds the binder's lease and its loops run."""
        return self._term.current is not None

    @property
    def lease_ttl(self) -> float:
        """The lease's ttl this router judges validity by (see :meth:`start`)."""
        return self._lease.ttl

    @property
    def holder(self) -> str:
        """This router's name in the binder's lease (unique per instance)."""
        return self._lease.holder

    async def _start(self) -> None:
        """Open the state, listen, and seek the binder's lease (bind if it is free)."""
        consumer_configs = router_consumer_configs(self._config)
        self._state = await StateView.open(
            self._js, supervisor=self._supervisor, name=f"{self._name}-state"
        )
        self._parts.view = self._state
        if self._cancels is not None:
            self._unlisten = self._cancels.listen(self._intake.on_cancel_requested)
        self._subs.append(await self._nc.subscribe(capacity_subject("*"), cb=self._round.on_freed))
        self._subs.append(await self._nc.subscribe(boost_subject("*"), cb=self._intake.on_boost))
        await self._term.open(consumer_configs)
        self._supervise("lease", self._term.lease_loop)
        self._supervise("renew", self._term.renew_loop)
        log.info(
            "router started",
            router=self._name,
            levels=list(self._config.priorities),
            role="binder" if self.binding else "standby",
        )

    def _loop_name(self, what: str) -> str:
        return loop_name(self._name, what)

    def _supervise(self, what: str, factory: Callable[[], Any]) -> None:
        name = self._loop_name(what)
        self._loops.append(name)
        self._supervisor.spawn(name, factory)

    async def _close(self) -> None:
        """Stop taking work, let in-flight dispatches land, give the lease up."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        # Before any await: a timer that fired later would spawn a job on a
        # connection about to be left (a restart on a new one).
        self._intake.stop_timers()
        # Jobs cut short leave their follower in its group: its leader's hand-out ends it.
        await self._supervisor.cancel(*self._loops, *self._supervisor.jobs(self._intake.job_prefix))
        self._loops.clear()
        await self._term.close()
        # Unsubscribe, or a pull that expires after the fetch task is gone
        # leaves a status message no one reads, and draining NATS waits on it.
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._state is not None:
            await self._state.close()
        if self._own_supervisor:
            await self._supervisor.close()
        await self._parts.inflight.settle(within=_INFLIGHT_STOP_WAIT)
        # Last: a standby takes over at once, and re-created consumers give
        # it what this router held (see Term._begin).
        try:
            await self._lease.release()
        except Exception as exc:  # noqa: BLE001 - then it expires within the ttl
            log.warning("could not release the binder's lease", error=str(exc))
        log.info("router stopped", router=self._name, routed=self.routed)
