"""Owning background tasks: supervise them while they run, cancel them for sure.

Every long-lived loop of a service (a router's fetch and dispatch loops, a
worker's fetch loop, the projector, the watches) runs under a
:class:`Supervisor`. The rules, from the review that found loops dying in
silence while their work was kept alive:

- A loop that raises is logged (with the traceback) and started again after a
  capped, jittered backoff: a broker hiccup, a reconnect or a timed-out API
  call costs a pause, never the loop. A transient broker fault (a
  :class:`~renqueue.errors.NatsUnavailableError` other than a closed
  connection: no answer in time, no responders, a 503 while a restarted
  server recovers its streams) is expected on every broker restart: it is a
  warning, without a traceback, and restarted the same way.
- A loop that keeps failing (``give_up_after`` consecutive failures with no
  healthy stretch in between, not counting the broker's faults: no answer, a
  closed connection; or failing for the broker's sake alone, with no run of
  ``PROGRESS_AFTER`` seconds in between, for longer than ``broker_patience``,
  a process's ``nats.patience``: a NATS outage is waited out that long, and a
  closed connection is replaced meanwhile by the services'
  ``ConnectionKeeper``; a full store, :class:`~renqueue.errors.StoreFullError`,
  is waited out however long it lasts: room comes back as work is done, old
  data ages out or a limit is raised, and a restart would not bring it), or
  raises :class:`Fatal`, cannot go on: the
  supervisor records why and sets :attr:`Supervisor.failed`. The process
  (``renqueue up``/``router``/``worker``) then shuts down and exits non-zero,
  so a process supervisor (systemd, Kubernetes) restarts it, and every message
  it held goes back to the broker for another instance.
- Work kept alive for a loop (the router's ``in_progress()`` keepalives) asks
  :meth:`Supervisor.healthy` first: nothing is kept alive for a loop that is
  down.
- A one-off piece of work that must not be lost to a transient error (ending
  a coalesced follower at its deadline or on its cancellation) runs as a
  *job* (:meth:`Supervisor.spawn_job`): retried under the same backoff until
  it succeeds, forgotten once it has, and failing the supervisor like a loop
  if it keeps failing. Jobs do not count in :meth:`Supervisor.healthy`.

Python 3.11's ``asyncio.wait_for`` (which nats-py uses inside ``fetch`` and
``next_msg``) can swallow a cancellation that arrives together with a reply:
the task carries on as if never cancelled. A single ``cancel()`` followed by an
unbounded wait can then hang a shutdown forever (seen in the router: 9 stops in
40). :func:`cancel_and_wait` repeats the cancel until every task has ended.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection, Coroutine
from typing import Any, Final

from .errors import NatsClosedError, NatsUnavailableError, StoreFullError
from .logs import get_logger

__all__ = ["Fatal", "Supervisor", "cancel_and_wait"]

log = get_logger("tasks")

#: A loop that has run this long since its last failure is healthy again: its
#: failure count and backoff start over.
HEALTHY_AFTER: Final = 30.0
#: A run that lasted this long ends a streak of broker faults: the broker
#: answered it for a while (longer than any one call waits for an answer).
PROGRESS_AFTER: Final = 10.0


class Fatal(Exception):
    """Raised by a supervised loop that cannot go on: the process must stop."""


def _transient(exc: Exception) -> bool:
    """Whether ``exc`` is a broker fault that passes by itself: the broker did
    not answer, for now. A closed connection does not come back by itself;
    anything else may be a bug, whose traceback is wanted."""
    return isinstance(exc, NatsUnavailableError) and not isinstance(exc, NatsClosedError)


class _Loop:
    """One supervised loop: its task, failure streak and last sign of life."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.task: asyncio.Task[None] | None = None
        self.failures = 0
        #: Of ``failures``, those not the broker's (no answer, a closed
        #: connection): ``give_up_after`` of these give up. A broker that does
        #: not answer is waited for up to ``broker_patience`` seconds instead.
        self.faults = 0
        #: When the current streak of failures began (loop time), reset by a
        #: run of ``PROGRESS_AFTER`` seconds; None: none.
        self.failing_since: float | None = None
        self.running = False
        self.error: str | None = None


class Supervisor:
    """Runs a process's background loops; restarts failed ones; says when one is dead.

    ``spawn(name, factory)`` runs ``await factory()`` and, if it raises, logs
    and runs it again after ``min(max_backoff, base * 2**n)`` seconds (with
    jitter). A loop that returns normally has finished its job and is not
    restarted. :meth:`close` cancels every loop for sure (idempotent).
    """

    def __init__(
        self,
        name: str,
        *,
        base_backoff: float = 0.1,
        max_backoff: float = 5.0,
        give_up_after: int = 20,
        broker_patience: float = 300.0,
    ) -> None:
        self._name = name
        self._base = base_backoff
        self._max = max_backoff
        self._give_up_after = give_up_after
        #: How long a loop may fail for the broker's sake alone (no answer, a
        #: closed connection) before it gives up: the process's ``nats.patience``.
        self.broker_patience = broker_patience
        self._loops: dict[str, _Loop] = {}
        self._jobs: dict[str, _Loop] = {}
        #: Set once a loop cannot go on; :attr:`reason` says which and why.
        self.failed = asyncio.Event()
        self.reason: str | None = None
        self._closed = False

    def spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``factory()`` as supervised loop ``name`` (unique within this supervisor)."""
        if self._closed:
            raise RuntimeError(f"supervisor {self._name} is closed")
        if name in self._loops:
            raise ValueError(f"loop {name!r} is already supervised")
        loop = _Loop(name)
        self._loops[name] = loop
        loop.task = asyncio.create_task(self._supervise(loop, factory), name=f"{self._name}-{name}")

    def spawn_job(self, name: str, factory: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``factory()`` until it returns, retried like a loop when it raises.

        For idempotent one-off work. False (and nothing started) if job
        ``name`` is still running: the same work is already under way.
        """
        if self._closed:
            raise RuntimeError(f"supervisor {self._name} is closed")
        if name in self._jobs:
            return False
        job = _Loop(name)
        self._jobs[name] = job

        async def run() -> None:
            try:
                await self._supervise(job, factory)
            finally:
                self._jobs.pop(name, None)

        job.task = asyncio.create_task(run(), name=f"{self._name}-{name}")
        return True

    def jobs(self, prefix: str = "") -> list[str]:
        """The names of the jobs still running that start with ``prefix``."""
        return [name for name in self._jobs if name.startswith(prefix)]

    def healthy(self, name: str | None = None) -> bool:
        """True while loop ``name`` (default: every loop) runs and the supervisor has not failed.

        A loop that is unknown, stopped, or waiting out its backoff is not healthy.
        """
        if self.failed.is_set() or self._closed:
            return False
        if name is None:
            return all(loop.running for loop in self._loops.values())
        loop = self._loops.get(name)
        return loop is not None and loop.running

    def failures(self, name: str) -> int:
        """Loop ``name``'s failures in a row (0 for an unknown loop); reset after
        ``HEALTHY_AFTER`` seconds of running without one."""
        loop = self._loops.get(name)
        return 0 if loop is None else loop.failures

    async def cancel(self, *names: str) -> None:
        """Cancel the named loops (or jobs) and wait until they have ended; forget them.

        For a service that stops before the rest of its process (a router's
        ``close()`` ends its loops before handing its held requests back).
        Unknown names are ignored; a stopped loop is not healthy.
        """
        loops = [self._loops.pop(name) for name in names if name in self._loops]
        loops += [self._jobs.pop(name) for name in names if name in self._jobs]
        await cancel_and_wait([loop.task for loop in loops if loop.task is not None])

    async def close(self) -> None:
        """Cancel every loop and job and wait until they have all ended. Idempotent."""
        self._closed = True
        loops = [*self._loops.values(), *self._jobs.values()]
        await cancel_and_wait([loop.task for loop in loops if loop.task])

    def _fail(self, loop: _Loop, reason: str) -> None:
        loop.error = reason
        if self.reason is None:
            self.reason = f"{self._name}: loop {loop.name!r} cannot go on: {reason}"
        log.critical(
            "background loop cannot go on", supervisor=self._name, loop=loop.name, reason=reason
        )
        self.failed.set()

    async def _supervise(
        self, loop: _Loop, factory: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        event_loop = asyncio.get_running_loop()
        while True:
            began = event_loop.time()
            loop.running = True
            try:
                await factory()
            except asyncio.CancelledError:
                loop.running = False
                raise
            except Fatal as exc:
                loop.running = False
                self._fail(loop, str(exc) or type(exc).__name__)
                return
            except Exception as exc:
                loop.running = False
                now = event_loop.time()
                if now - began >= HEALTHY_AFTER:
                    loop.failures = loop.faults = 0
                if now - began >= PROGRESS_AFTER:
                    loop.failing_since = None  # it ran a while: not one long outage
                loop.failures += 1
                if loop.failing_since is None:
                    loop.failing_since = now
                if not isinstance(exc, NatsUnavailableError):
                    loop.faults += 1
                if loop.faults >= self._give_up_after:
                    self._fail(loop, f"failed {loop.failures} times in a row; last: {exc!r}")
                    return
                if (
                    loop.faults == 0
                    and now - loop.failing_since > self.broker_patience
                    and not isinstance(exc, StoreFullError)  # room comes back; a restart won't
                ):
                    self._fail(
                        loop,
                        f"failed for {now - loop.failing_since:.0f} s "
                        f"({loop.failures} times in a row); last: {exc!r}",
                    )
                    return
                delay = min(self._max, self._base * 2 ** (loop.failures - 1))
                delay *= random.uniform(0.5, 1.0)
                fields = {
                    "supervisor": self._name,
                    "loop": loop.name,
                    "failures": loop.failures,
                    "retry_in": round(delay, 3),
                }
                if _transient(exc):
                    log.warning("background loop failed; restarting", error=repr(exc), **fields)
                else:
                    log.exception("background loop failed; restarting", **fields)
                await asyncio.sleep(delay)
                continue
            loop.running = False
            return


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], *, every: float = 0.2) -> None:
    """Cancel ``tasks`` and wait until all have ended, cancelling again every ``every`` s.

    Exceptions the tasks end with are retrieved (not raised): a loop that died
    of an error is already over, which is all a shutdown needs.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=every)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # mark retrieved: no "exception never retrieved" noise
