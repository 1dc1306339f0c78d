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

With binding split in groups (docs/scaling.md: several binding groups, routes
that share no backend), a router runs one binder per group in the process
(:class:`Binder`: its own lease ``binder.<group>``, term, consumers, hold and
books, over the group's routes and backends only), seeks at most its share of
the groups' leases (``_share``), and forwards requests published without
their route to their group's subject (``_forward``). With one group every
subject, consumer and lease is the unsplit one.

The decisions are plain functions in :mod:`renqueue.policy` (a round:
:func:`~renqueue.policy.plan`; admission: :func:`~renqueue.policy.validate`);
the stages are the loops around them that do the NATS work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
    Message,
    Subscription,
    ensure_router_consumers,
    router_consumer_configs,
)
from ...config import BindingGroup, Config, parse_duration
from ...coordination import CancelWatch, Coalescer, Lease, LiveState, StateView
from ...lifecycle import Lifecycle
from ...logs import get_logger
from ...schema import (
    FORWARD_CONSUMER,
    CancelRequested,
    binder_lease,
    boost_subject,
    capacity_subject,
    subject_matches,
)
from ...tasks import Supervisor
from ._dispatch import ACKS_TIMEOUT
from ._endings import Endings
from ._forward import Forwarder, open_forwarding
from ._hold import Hold
from ._inflight import Inflight
from ._intake import UNTAKEABLE_AFTER, Intake
from ._ledger import Ledger
from ._parts import Parts
from ._placement import Placement
from ._round import Round
from ._share import Share
from ._spending import Spending
from ._term import Term, loop_name

__all__ = ["UNTAKEABLE_AFTER", "Binder", "Router"]

log = get_logger("router")

#: How long a stop waits for decisions still being published (each is bounded
#: by ``ACKS_TIMEOUT`` already; this is the backstop).
_INFLIGHT_STOP_WAIT: Final = ACKS_TIMEOUT + 5.0


class Binder:
    """One binding group's binder in a router process: its lease, term, hold and
    books (the whole config's when binding is not split; see the module doc)."""

    def __init__(
        self,
        nc: Connection,
        js: JetStream,
        config: Config,
        *,
        name: str,
        holder: str,
        group: BindingGroup | None,
        clock: Callable[[], float],
        cancels: CancelWatch | None,
        supervisor: Supervisor,
        may_seek: Callable[[], bool] = lambda: True,
        seek_lock: asyncio.Lock | None = None,
    ) -> None:
        #: The group bound here (None: binding is not split).
        self.group = group
        self.config = config if group is None else config.for_group(group)
        self.lease = Lease(
            js,
            binder_lease(None if group is None else group.name),
            holder=holder,
            ttl=parse_duration(config.router.lease_ttl),
        )
        events = EventLog(js)
        coalescer = Coalescer(js, clock=clock, ttl=parse_duration(config.router.coalesce_ttl))
        self.parts = Parts(
            nc=nc,
            js=js,
            config=self.config,
            clock=clock,
            log=events,
            lease=self.lease,
            hold=Hold(list(config.priorities), config.router.hold_limit),
            ledger=Ledger(self.config),
            placement=Placement(self.config),
            spending=Spending(self.config),
            endings=Endings(events, coalescer, clock=clock),
            inflight=Inflight(),
        )
        self.round = Round(self.parts)
        self.intake = Intake(
            self.parts,
            name=name,
            supervisor=supervisor,
            coalescer=coalescer,
            cancels=cancels,
        )
        self.term = Term(
            self.parts,
            name=name,
            supervisor=supervisor,
            intake=self.intake,
            round_=self.round,
            group=None if group is None else group.name,
            may_seek=may_seek,
            seek_lock=seek_lock,
        )

    def held_term(self) -> int | None:
        """The term of the lease this router holds for the group (None: not held)."""
        return self.lease.term if self.lease.held else None


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
        holder = f"{name}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        groups: tuple[BindingGroup | None, ...] = (
            config.binding_groups() if config.sharded() else (None,)
        )
        #: This router's share of the groups' leases (binding split in groups only).
        self._share: Share | None = None
        if len(groups) > 1:
            self._share = Share(
                js,
                groups=len(groups),
                ttl=parse_duration(config.router.lease_ttl),
                held=lambda: [binder.held_term() for binder in self._binders],
                failing=lambda: any(binder.term.sitting_out() for binder in self._binders),
            )
        share = self._share
        seek_lock = asyncio.Lock()
        #: One binder per binding group (one, over the whole config, when not split).
        self._binders = [
            Binder(
                nc,
                js,
                config,
                name=name if group is None else f"{name}-{group.name}",
                holder=holder,
                group=group,
                clock=clock,
                cancels=cancels,
                supervisor=self._supervisor,
                may_seek=(lambda: True) if share is None else share.may_seek,
                seek_lock=seek_lock,
            )
            for group in groups
        ]
        #: Which binder a backend's freed slot wakes (binding split in groups).
        self._binder_of_backend = {
            backend: binder
            for binder in self._binders
            if binder.group is not None
            for backend in binder.group.backends
        }
        #: Requests sent without their route, sent on to it (binding split in groups).
        self._forwarder = (
            None if share is None else Forwarder(nc, js, config, self._binders[0].parts.endings)
        )
        first = self._binders[0]
        #: The (first) binder's parts: the lease, the books (binding not split: the only ones).
        self._parts = first.parts
        self._lease = first.lease
        self._round = first.round
        self._intake = first.intake
        self._term = first.term

    @property
    def routed(self) -> int:
        """Requests this router bound (their decisions stored)."""
        return sum(binder.round.routed for binder in self._binders)

    @property
    def rejected(self) -> int:
        """Requests this router rejected."""
        return sum(binder.parts.endings.rejected for binder in self._binders)

    @property
    def projection(self) -> LiveState | None:
        """What this router knows of the projection (``None`` before it starts)."""
        return None if self._state is None else self._state.state

    @property
    def binding(self) -> bool:
        """Whether this router holds a binder's lease (any group's) and its loops run."""
        return any(binder.term.current is not None for binder in self._binders)

    @property
    def binding_groups(self) -> list[str]:
        """The binding groups whose terms run here (binding split in groups; else ``[]``)."""
        return [
            binder.group.name
            for binder in self._binders
            if binder.group is not None and binder.term.current is not None
        ]

    @property
    def forwarded(self) -> int:
        """Requests sent without their route that this router sent on to it."""
        return 0 if self._forwarder is None else self._forwarder.forwarded

    @property
    def lease_ttl(self) -> float:
        """The lease's ttl this router judges validity by (see :meth:`start`)."""
        return self._lease.ttl

    @property
    def holder(self) -> str:
        """This router's name in the binders' leases (unique per instance)."""
        return self._lease.holder

    async def _start(self) -> None:
        """Open the state, listen, and seek the binders' leases (bind if free)."""
        self._state = await StateView.open(
            self._js, supervisor=self._supervisor, name=f"{self._name}-state"
        )
        for binder in self._binders:
            binder.parts.view = self._state
        if self._cancels is not None:
            self._unlisten = self._cancels.listen(self._on_cancel_requested)
        freed = self._round.on_freed if self._share is None else self._on_freed
        self._subs.append(await self._nc.subscribe(capacity_subject("*"), cb=freed))
        self._subs.append(await self._nc.subscribe(boost_subject("*"), cb=self._on_boost))
        if self._forwarder is not None:
            await ensure_router_consumers(
                self._nc, router_consumer_configs(self._config, group=FORWARD_CONSUMER)
            )
            self._supervise("forward", self._forward_loop)
        for binder in self._binders:
            group = None if binder.group is None else binder.group.name
            await binder.term.open(router_consumer_configs(self._config, group=group))
            suffix = "" if group is None else f"-{group}"
            self._supervise(f"lease{suffix}", binder.term.lease_loop)
            self._supervise(f"renew{suffix}", binder.term.renew_loop)
        if self._share is not None:
            self._supervise("share", functools.partial(self._share.loop, self._give_up))
        log.info(
            "router started",
            router=self._name,
            levels=list(self._config.priorities),
            role="binder" if self.binding else "standby",
            groups=self.binding_groups or None,
        )

    def _on_cancel_requested(self, event: CancelRequested) -> None:
        """A cancellation: each binder drops the request if it holds it; the
        first alone ends a coalesced follower held nowhere."""
        for index, binder in enumerate(self._binders):
            binder.intake.on_cancel_requested(event, followers=index == 0)

    async def _on_freed(self, msg: Message) -> None:
        """A freed slot wakes the binder of its backend's group (binding split)."""
        if not subject_matches(capacity_subject("*"), msg.subject):
            await self._round.on_freed(msg)  # counted as misdirected there
            return
        binder = self._binder_of_backend.get(msg.subject.rsplit(".", 1)[-1])
        if binder is not None:
            await binder.round.on_freed(msg)

    async def _on_boost(self, msg: Message) -> None:
        for binder in self._binders:
            await binder.intake.on_boost(msg)

    async def _give_up(self, index: int) -> None:
        """Hand group ``index``'s lease back: this router holds more than its share."""
        await self._binders[index].term.give_up(
            "this router holds more groups than its share", failing=False
        )

    async def _forward_loop(self) -> None:
        assert self._forwarder is not None
        psub = await open_forwarding(self._js)
        try:
            await self._forwarder.loop(psub)
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    def _loop_name(self, what: str) -> str:
        return loop_name(self._name, what)

    def _supervise(self, what: str, factory: Callable[[], Any]) -> None:
        name = self._loop_name(what)
        self._loops.append(name)
        self._supervisor.spawn(name, factory)

    async def _close(self) -> None:
        """Stop taking work, let in-flight dispatches land, give the leases up."""
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        # Before any await: a timer that fired later would spawn a job on a
        # connection about to be left (a restart on a new one).
        for binder in self._binders:
            binder.intake.stop_timers()
        # Jobs cut short leave their follower in its group: its leader's hand-out ends it.
        jobs = [job for b in self._binders for job in self._supervisor.jobs(b.intake.job_prefix)]
        await self._supervisor.cancel(*self._loops, *jobs)
        self._loops.clear()
        if self._share is not None:
            # First: the others count this router out while it still holds its
            # leases, so each is sought as soon as it is released below.
            try:
                await self._share.leave()
            except Exception as exc:  # noqa: BLE001 - then it expires within the ttl
                log.warning("could not take the router's heartbeat away", error=str(exc))
        for binder in self._binders:
            await binder.term.close()
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
        for binder in self._binders:
            await binder.parts.inflight.settle(within=_INFLIGHT_STOP_WAIT)
        # Last: a standby takes over at once, and re-created consumers give
        # it what this router held (see Term._begin).
        for binder in self._binders:
            try:
                await binder.lease.release()
            except Exception as exc:  # noqa: BLE001 - then it expires within the ttl
                log.warning("could not release the binder's lease", error=str(exc))
        log.info("router stopped", router=self._name, routed=self.routed)
