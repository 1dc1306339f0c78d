"""The one lifecycle of every long-lived component: start once, close once.

Router, worker, projector, state view, cancel watch, advisory reader and
:class:`~renqueue.services.Services` all subclass :class:`Lifecycle`:

- ``UNOPENED`` -> :meth:`Lifecycle.start` -> ``RUNNING`` -> :meth:`Lifecycle.close`
  -> ``DRAINING`` -> ``CLOSED``. A component is started at most once: a second
  start, or a start after a stop, raises :class:`RuntimeError` naming it.
- A start that fails (or is cancelled) stops what it got to open, so the
  component ends ``CLOSED`` and the error propagates.
- :meth:`Lifecycle.close` is idempotent: the component's ``_close`` runs once; a
  stop while another is under way waits for it. Stopping a component never
  started just marks it ``CLOSED``.
- ``async with component:`` starts it and stops it on exit.

Subclasses implement ``_start`` and ``_close``; ``_close`` must cope with a
``_start`` that got only part of the way.
"""

from __future__ import annotations

import asyncio
import enum
from types import TracebackType
from typing import Self

__all__ = ["Closing", "Lifecycle", "Starting", "State"]


class State(enum.Enum):
    UNOPENED = "unopened"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


class Closing:
    """Something open once made, closed by ``await it.close()`` or at the end
    of ``async with it:`` (a client, a backend adapter)."""

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class Starting(Closing):
    """Something started by ``await it.start()`` and closed by ``close()``:
    ``async with it:`` does both (a server, a component)."""

    async def start(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self


class Lifecycle(Starting):
    """Base of every long-lived component (see the module docstring)."""

    _status: State = State.UNOPENED
    _stopped: asyncio.Event | None = None

    @property
    def status(self) -> State:
        """Where this component is in its lifecycle."""
        return self._status

    def _describe(self) -> str:
        """The component, for error messages: its class and, if it has one, its name."""
        name = getattr(self, "_name", None)
        kind = type(self).__name__
        return f"{kind} {name!r}" if isinstance(name, str) else kind

    async def start(self) -> None:
        """Start: ``UNOPENED`` -> ``RUNNING``. Raises RuntimeError if started before."""
        if self._status is not State.UNOPENED:
            raise RuntimeError(
                f"cannot start {self._describe()}: it is {self._status.value}"
                " (a component is started once)"
            )
        self._status = State.RUNNING
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop: ``RUNNING`` -> ``DRAINING`` -> ``CLOSED``, running ``_close`` once. Idempotent."""
        if self._status is State.UNOPENED:
            self._status = State.CLOSED
            return
        if self._status is State.CLOSED:
            return
        if self._status is State.DRAINING:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._status = State.DRAINING
        self._stopped = asyncio.Event()
        try:
            await self._close()
        finally:
            self._status = State.CLOSED
            self._stopped.set()

    async def _start(self) -> None:
        """Open what the component needs; called once, by :meth:`start`."""

    async def _close(self) -> None:
        """Close what ``_start`` opened (maybe only part of it); called once, by :meth:`close`."""
