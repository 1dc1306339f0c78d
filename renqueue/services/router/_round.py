"""The round: planning which held requests to bind now, and carrying it out.

While a term runs, a single dispatch loop (:meth:`Round.loop`) runs rounds,
each when woken (a slot freed, a request read or boosted) or after a pause.
A round takes the held requests highest level first, oldest first, and binds
each to the first candidate of its route that is healthy, capable and has a
free slot *now*. A request whose candidates are all full stays held (its ack
timer kept alive by the term) until a slot frees: backends are never given
more work than their concurrency, so backend subjects stay short and waiting
happens where priority applies.

The decisions are :func:`renqueue.policy.plan`'s, over a snapshot of the
hold (plain data) and of each backend: its free slots (``_capacity``: broker
truth plus this binder's own dispatches the broker may not have counted
yet), its quota (``_ledger``), its circuit (``_circuits``). The round carries
them out: binds (``_dispatch``: the dispatch, the decision, the ack),
expiries and budget refusals (``_endings``), promotions, asks for a
preemption (``_asking``), and the circuit and A/B changes it judges, each
decision's publishes in a task of its own (``_inflight``). A new term binds
nothing to a backend its ledger judges before its view of the projection has
caught up with the log (``_catch_up``).

A failed round (a JetStream call that timed out, had no responders, or found
a consumer gone) hands every held request back (nak'ed) and ends the loop for
the supervisor to start again; nothing is fetched meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterable
from typing import Final

import msgspec

from ...broker import Message
from ...config import parse_duration
from ...coordination import LiveState, StateView
from ...logs import get_logger, misdirected
from ...policy import (
    Action,
    AskPreemption,
    BackendView,
    Bind,
    Circuit,
    Cost,
    Expire,
    Inherit,
    PlanPolicy,
    Promote,
    Refuse,
    Wait,
    Waiting,
    budget_exhausted,
    least_urgent_victim,
    plan,
    promise,
)
from ...schema import (
    EVENTS_STREAM,
    REQUESTS_STREAM,
    CircuitChanged,
    SplitChanged,
    capacity_subject,
    promoted,
)
from ._asking import ask_preemption
from ._capacity import Capacity
from ._catch_up import CatchUp
from ._circuits import Circuits, change_event
from ._dispatch import Dispatcher
from ._hold import Held, first_then, log_first
from ._parts import Parts

__all__ = ["Round"]

log = get_logger("router")

#: ``rq.capacity.``: a worker's word that it freed a slot of the backend named next.
_FREED_PREFIX: Final = capacity_subject("")
#: Seconds between rounds while nothing waits: each backend's circuit is
#: judged (and a change logged) at least this often.
_IDLE_ROUND: Final = 1.0


def freed_backend(subject: str) -> str | None:
    """The backend a worker's word on ``subject`` says it freed a slot of:
    ``subject`` is ``rq.capacity.<one token>`` (as ``subject_matches`` of
    ``capacity_subject("*")`` judges, without splitting it); else ``None``."""
    backend = subject.removeprefix(_FREED_PREFIX)
    return None if backend == subject or "." in backend else backend


class Round:
    """The binder's rounds (see the module docstring)."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        self._nc = parts.nc
        self._js = parts.js
        self._config = parts.config
        self._clock = parts.clock
        self._log = parts.log
        self._lease = parts.lease
        self._hold = parts.hold
        self._ledger = parts.ledger
        self._placement = parts.placement
        self._spending = parts.spending
        self._endings = parts.endings
        self._inflight = parts.inflight
        self._levels = list(parts.config.priorities)
        # Health is each backend's circuit, judged in the round.
        self._circuits = Circuits(parts.config)
        self._capacity = Capacity(
            parts.js, parts.config, parse_duration(parts.config.router.capacity_refresh)
        )
        self._catch_up = CatchUp(parts.config)
        self._dispatcher = Dispatcher(
            parts.js,
            parts.log,
            parts.config,
            holder=parts.lease.holder,
            clock=parts.clock,
            end_request=parts.endings.end,
        )

    @property
    def routed(self) -> int:
        """Requests bound (their decisions stored)."""
        return self._dispatcher.routed

    @functools.cached_property
    def _plan_policy(self) -> PlanPolicy:
        return self._config.plan_policy()

    @functools.cached_property
    def _least_urgent(self) -> int | None:
        """The least urgent rank a run may be preempted at (an offer of one is
        taken at once)."""
        return least_urgent_victim(self._config.level_policies())

    async def on_freed(self, msg: Message) -> None:
        """A worker freed a slot of its backend: a round may bind more."""
        # A tenant's push consumer can deliver here (its messages keep their
        # own subjects): only rq.capacity.<backend> (one token) is a worker's word.
        backend = freed_backend(msg.subject)
        if backend is None:
            misdirected("capacity", msg.subject)
            return
        self._capacity.freed(backend)
        self._parts.wake.set()

    async def begin(self) -> None:
        """A term begins: note where it begins in the request stream and in the log."""
        # Read before the consumers are re-created: whatever they deliver from
        # here down may have been bound by the binder before (its last acts).
        info = await self._js.stream_info(REQUESTS_STREAM)
        self._dispatcher.term_first_seq = info.state.last_seq + 1
        # Quota: bind only on a view that has folded every decision logged so
        # far (the previous binder's last ones among them).
        logged = await self._js.stream_info(EVENTS_STREAM)
        self._catch_up.begin(logged.state.last_seq)

    def end(self) -> None:
        """The term ended (its loop stopped): forget what its rounds judged."""
        self._parts.dispatching.clear()
        self._catch_up.end()
        self._circuits.forget()
        self._placement.splitter.forget()

    async def loop(self, term: int) -> None:
        """Dispatch rounds of lease term ``term``, each when woken. A failed
        round (a JetStream call that timed out, had no responders, or found a
        consumer gone) hands every held request back for another router and
        ends the loop: the supervisor logs it and starts it again after a
        backoff, and nothing is fetched meanwhile."""
        refresh = parse_duration(self._config.router.capacity_refresh)
        wake = self._parts.wake
        self._parts.dispatching.set()
        try:
            while True:
                await self._lease.until_valid()
                waiting = await self._round(term)
                # With requests waiting for room, look again after the refresh
                # interval even if no worker announces a freed slot; with none,
                # every second all the same (circuits move with time).
                # (A timeout around the wait: no task to run it in, as wait_for made.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(refresh if waiting else _IDLE_ROUND):
                        await wake.wait()
                wake.clear()
        except Exception as exc:
            self._parts.dispatching.clear()
            await self._hold.hand_back(self._levels, f"dispatch failed: {exc!r}")
            raise

    async def _round(self, term: int) -> list[str]:
        """Bind every held request that can be bound now, most urgent first.

        The decisions are :func:`renqueue.policy.plan`'s, over a snapshot of
        the hold (plain data) and of backend load; this carries them out (the
        publishes, the acks) and keeps the bookkeeping they name. Returns the
        backends that held requests are waiting on.

        Backend load is read once, before the plan, and carrying it out never
        awaits: a slot that frees meanwhile cannot go to whichever request the
        round happens to be at; it goes to the head of the order next round.
        """
        now = self._clock()
        self._placement.follow(self._hold, self._parts.live())
        held = list(self._hold)
        demand: dict[str, int] = {}
        for item in held:
            for name in self._config.routes[item.request.route].backends:
                demand[name] = demand.get(name, 0) + 1
        wanted = set(demand)
        await self._capacity.refresh(sorted(wanted), demand=demand)
        state = self._parts.view
        # While a new term's view lags the log, binds to backends the ledger
        # judges are held (may await a read of the stored projection).
        catching_up = await self._catch_up.pending(state)
        if not self._lease.valid():
            # The lease may have passed on while the load was read: decide nothing.
            return sorted(wanted)
        projected = None if state is None else state.state
        items, snapshot = self._snapshot(held)
        self._ledger.prune(projected)
        self._judge_splits(projected, now, term)
        views, judged = self._views(state, now, term)
        spent = self._spending.today(projected, (item.request.tenant for item in snapshot), now)
        actions = plan(snapshot, views, now, self._plan_policy, spent)
        waiting, gone = self._carry_out(
            actions, items, now, term, held_back=judged if catching_up else set()
        )
        self._hold.prune(gone)
        return sorted(waiting)

    def _snapshot(self, held: list[Held]) -> tuple[dict[int, Held], list[Waiting]]:
        """The requests of ``held`` still held, by reference, and the plan's
        plain copy of them. (Requests dropped while the round awaited,
        cancelled or handed back, are no longer this router's to bind.)"""
        present = {id(item) for item in self._hold}
        items = {id(item): item for item in held if id(item) in present}
        snapshot = [
            Waiting(
                ref=ref,
                request=item.request,
                rank=item.rank,
                submitted=item.submitted,
                parent=item.parent,
                boost=item.boost,
                promoted=item.promoted,
                inherited=item.inherited,
                preempt_asked=item.preempt_asked,
                preempted_one=item.preempted_one,
                waiting_for=item.waiting_for,
            )
            for ref, item in items.items()
        ]
        return items, snapshot

    def _carry_out(
        self,
        actions: Iterable[Action],
        items: dict[int, Held],
        now: float,
        term: int,
        *,
        held_back: set[str],
    ) -> tuple[set[str], set[int]]:
        """Carry out the plan's ``actions``, binding nothing to a backend of
        ``held_back``; the backends held requests wait on, and the requests
        that left the hold (by reference)."""
        waiting: set[str] = set()
        gone: set[int] = set()
        for action in actions:
            item = items[action.ref]
            if isinstance(action, Bind):  # (the usual action first)
                if action.backend in held_back:
                    # Its quota is judged on a view that may not know yet what
                    # the previous binder spent: it waits (held) for the view.
                    waiting.add(action.backend)
                else:
                    gone.add(action.ref)
                    self._bind(item, action, now, term)
            elif isinstance(action, Promote | Inherit):
                self._announce_promotion(item, action)
            elif isinstance(action, Expire):
                gone.add(action.ref)
                expire = functools.partial(
                    self._endings.expire, item.msg, item.request, now, reason=action.reason
                )
                self._inflight.spawn(first_then(item, self._log, expire))
            elif isinstance(action, Refuse):
                gone.add(action.ref)
                request = item.request
                error = budget_exhausted(
                    request, action.daily, action.spent, now, mode=action.mode, cost=action.cost
                )
                reject = functools.partial(
                    self._endings.reject,
                    item.msg,
                    request.id,
                    request.tenant,
                    error,
                    request=request,
                )
                self._inflight.spawn(first_then(item, self._log, reject))
            elif isinstance(action, AskPreemption):
                self._maybe_preempt(item, action, now)
            elif isinstance(action, Wait):
                waiting.update(action.backends)
                item.waiting_for = promise(item.waiting_for, action)
        # A request this round did not bind waits: its first word, left for
        # its binding to carry, goes into the log on its own now.
        for ref, item in items.items():
            if item.logged is None and ref not in gone:
                self._inflight.spawn(log_first(item, self._log))
        return waiting, gone

    def _bind(self, item: Held, action: Bind, now: float, term: int) -> None:
        """Carry out a binding: the slot, the probe, the quota reservation, and
        the dispatch and decision published in a task."""
        slot = self._capacity.dispatching(action.backend)
        if action.probe:
            self._circuits.probe_bound(action.backend, now)
        self._spending.bound(item.request.tenant, action.estimated_cost, now)
        reserved = self._ledger.reserving(
            action.backend, Cost(requests=1, tokens=action.reserved_tokens), now
        )
        # The term is the deciding round's, not whichever is current when it runs.
        self._inflight.spawn(
            self._dispatcher.bind(
                item,
                slot,
                self._levels[item.rank],
                now,
                action.reason,
                term=term,
                effective_rank=action.effective_rank,
                reserved=reserved,
                probe=action.probe,
                predicted=action.predicted,
                estimated_cost=action.estimated_cost,
            )
        )

    def _views(
        self, state: StateView | None, now: float, term: int
    ) -> tuple[dict[str, BackendView], set[str]]:
        """What the round knows of each backend (load, duration, quota, circuit),
        and the backends the ledger judges (limits declared or reported, a pause)."""
        projected = None if state is None else state.state
        views = {}
        judged: set[str] = set()
        for name, view in self._capacity.views().items():
            quota, limits = self._ledger.quota(name, projected, now=now)
            if quota is not None:
                judged.add(name)
            circuit = self._circuit(name, projected, now, term)
            views[name] = msgspec.structs.replace(
                view,
                expected_duration=None if state is None else state.expected_duration(name),
                perf=None if projected is None else projected.backend(name).perf,
                quota=quota,
                limits=limits,
                healthy=circuit.state != "open"
                and not (circuit.state == "half_open" and self._circuits.probe_pending(name, now)),
                half_open=circuit.state == "half_open",
            )
        return views, judged

    def _announce_promotion(self, item: Held, action: Promote | Inherit) -> None:
        """Record a promotion the planner announced: earned by aging (``at`` is
        when it was earned; message ids dedupe repeats) or inherited from the
        request's parent."""
        event = promoted(
            item.request.id,
            item.request.tenant,
            at=action.at,
            from_level=action.from_level,
            to_level=action.to_level,
            waited=action.waited,
            reason=action.reason,
        )
        if isinstance(action, Promote):
            item.promoted = action.promoted
        else:
            item.inherited = action.rank
        self._inflight.spawn(
            first_then(item, self._log, functools.partial(self._log.append, event))
        )

    def _maybe_preempt(self, item: Held, action: AskPreemption, now: float) -> None:
        """An urgent request finds every capable slot taken: ask for a
        preemptible one (the planner decided it may, and that it is time:
        :func:`renqueue.policy.plan`). The freed slot then goes to the most
        urgent waiting request, which is this one unless something more
        urgent arrived meanwhile."""
        item.preempt_asked = now
        self._inflight.spawn(self._ask_preemption(item, action.rank, list(action.backends)))

    async def _ask_preemption(self, item: Held, rank: int, backends: list[str]) -> None:
        """Free one slot for ``item`` (:func:`ask_preemption`), while it still waits here."""
        if await ask_preemption(
            self._nc,
            item.request,
            rank,
            backends,
            waiting=lambda: self._hold.holds(item),
            least_urgent=self._least_urgent,
        ):
            item.preempted_one = True

    def _circuit(self, name: str, projected: LiveState | None, now: float, term: int) -> Circuit:
        """Backend ``name``'s circuit this round (:class:`Circuits`); a change is logged."""
        facts = None if projected is None else projected.backends.get(name)
        circuit, previous = self._circuits.judge(name, facts, now, term=term)
        if previous is not None:
            event = change_event(name, circuit, previous, router=self._lease.holder, term=term)
            self._inflight.spawn(self._log_circuit(event, circuit))
        return circuit

    async def _log_circuit(self, event: CircuitChanged, circuit: Circuit) -> None:
        """Log a circuit change; if that fails, it is decided (and logged) again next round."""
        try:
            await self._log.append(event)
        except Exception as exc:  # noqa: BLE001 - the next round decides it again
            log.warning("could not log a circuit change", backend=event.backend, error=str(exc))
            self._circuits.retract(event.backend, circuit)

    def _judge_splits(self, projected: LiveState | None, now: float, term: int) -> None:
        """Roll back each live A/B split one of whose arms breaches its rules (logged)."""
        splitter = self._placement.splitter
        for event in splitter.judge(projected, now, router=self._lease.holder, term=term):
            self._inflight.spawn(self._log_split(event))

    async def _log_split(self, event: SplitChanged) -> None:
        """Log a rollback; if that fails, it is decided (and logged) again next round."""
        try:
            await self._log.append(event)
        except Exception as exc:  # noqa: BLE001 - the next round decides it again
            log.warning("could not log an A/B rollback", route=event.route, error=str(exc))
            self._placement.splitter.retract(event)
