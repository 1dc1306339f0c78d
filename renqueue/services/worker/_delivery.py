"""One delivered dispatch message, and the one answer the broker gets for it.

A :class:`Delivery` is a worker's hold on one message of the dispatch stream,
from fetch to answer. It renews the message's lease for as long as the run
that holds it is alive (:meth:`Delivery.keep_alive` until
:meth:`Delivery.stop_renewing`, or until the message's last answer), and
every answer the worker gives the broker for the message goes through it,
named for what it means:

- :meth:`~Delivery.done` (``ack``): the message's work is over and in the log
  (an outcome, a put-back to routing, a hand-over to a stolen copy, a step back);
- :meth:`~Delivery.hand_back` (``nak`` with a delay): deliver it again, to this
  worker or another of its backend, after that many seconds;
- :meth:`~Delivery.give_up` (``term``): never deliver it again (it is not a dispatch);
- :meth:`~Delivery.still_working` (``in_progress``): its run is alive; renew the lease.

Once opened (:meth:`Delivery.open`) it also carries what the run of the
dispatch is: the dispatch, the run's number over the request's life, the
:class:`~renqueue.schema.Run` its events are built from, and the token
chunks it streamed so far.
"""

from __future__ import annotations

import asyncio

from ...broker import Message, next_hop, trace_of
from ...logs import get_logger
from ...schema import DISPATCH_DECODER, Dispatch, Run, TraceParent
from ._call import Chunks

__all__ = ["Delivery"]

log = get_logger("worker")


class Delivery:
    """One message of a backend's dispatch consumer, from fetch to its answer."""

    #: The dispatch it carries (set by :meth:`open`).
    dispatch: Dispatch
    #: Its run's number over the request's whole life: the ``delivery`` of
    #: the run's events and token chunks.
    number: int
    #: The run its events are built from (``delivery.run.started(...)``).
    run: Run
    #: The token chunks its run streamed so far.
    chunks: Chunks
    #: The trace it came in (the router's span; a new trace when its
    #: ``traceparent`` header is missing or not valid).
    trace: TraceParent

    def __init__(self, msg: Message, *, ack_wait: float) -> None:
        self._msg = msg
        #: Its lease is renewed every third of the consumer's ``ack_wait``.
        self._renew_every = max(0.1, ack_wait / 3)
        #: The next renewal's timer, while its lease is kept alive.
        self._renewal: asyncio.TimerHandle | None = None
        #: A renewal under way.
        self._renewing: asyncio.Task[None] | None = None

    def open(self, *, backend: str, stride: int) -> Dispatch:
        """Decode the dispatch it carries and number its run on ``backend``;
        :class:`msgspec.DecodeError` if it is not a dispatch (poison).

        Runs are numbered over the request's whole life: redeliveries of this
        dispatch, and dispatches after a preemption (a higher attempt), each
        attempt ``stride`` numbers (the broker's delivery limit) above the last.
        """
        dispatch = self.dispatch = DISPATCH_DECODER.decode(self._msg.data)
        self.number = (dispatch.attempt - 1) * stride + self.delivered
        self.run = Run.of(dispatch, self.number, backend=backend)
        self.chunks = Chunks()
        self.trace = trace_of(self._msg.headers) or next_hop(None)
        return dispatch

    @property
    def data(self) -> bytes:
        """The message as stored."""
        return self._msg.data

    @property
    def subject(self) -> str:
        return self._msg.subject

    @property
    def stream_seq(self) -> int:
        """Its sequence in the dispatch stream."""
        return int(self._msg.metadata.sequence.stream)

    @property
    def delivered(self) -> int:
        """How many times the broker has delivered it (this time included)."""
        return int(self._msg.metadata.num_delivered)

    async def done(self, *, confirmed: bool = False) -> None:
        """Its work is over and recorded: the broker forgets it (``ack``).

        ``confirmed``: wait until the broker has taken the ack (``ack_sync``),
        so that a read of the consumer's counts made after this returns sees
        the slot free: the binder reads that count when the worker announces
        the freed slot, and an ack still on its way would leave the slot
        unseen until the binder's next periodic read.
        """
        self.stop_renewing()  # its last answer: no renewal after it
        if confirmed:
            await self._msg.ack_sync()
        else:
            await self._msg.ack()

    async def hand_back(self, *, after: float) -> None:
        """Deliver it again after ``after`` seconds (``nak`` with a delay).

        No renewal after it: the broker would take one for the lease of a
        delivery still pending and reset its timer to a whole ``ack_wait``
        (nats-server's progress update), putting the redelivery off.
        """
        self.stop_renewing()
        await self._msg.nak(delay=after)

    async def give_up(self) -> None:
        """Never deliver it again (``term``): it cannot be run by anyone."""
        self.stop_renewing()  # its last answer: no renewal after it
        await self._msg.term()

    async def still_working(self) -> None:
        """Its run is alive: renew its lease (``in_progress``)."""
        await self._msg.in_progress()

    def keep_alive(self) -> None:
        """Renew the lease every third of ``ack_wait`` until :meth:`stop_renewing`.

        A timer, not a task of its own: a renewal that falls due runs in a
        short task, and the next is timed when it is done.
        """
        self._renewal = asyncio.get_running_loop().call_later(self._renew_every, self._renew)

    def stop_renewing(self) -> None:
        """No more renewals: its run has ended, or the message has its last
        answer (:meth:`done`, :meth:`hand_back`, :meth:`give_up` call it
        first). A renewal under way is cancelled: one not begun never sends,
        and one that did sent before that answer."""
        renewal, self._renewal = self._renewal, None
        if renewal is not None:
            renewal.cancel()
        if self._renewing is not None:
            self._renewing.cancel()
            self._renewing = None

    def _renew(self) -> None:
        self._renewing = asyncio.get_running_loop().create_task(self._renew_once())

    async def _renew_once(self) -> None:
        try:
            await self.still_working()
        except Exception as exc:  # noqa: BLE001 - the next renewal may get through
            log.warning("could not renew a running request's lease", error=str(exc))
        if self._renewal is not None:  # still running: the next renewal
            self._renewing = None
            self._renewal = asyncio.get_running_loop().call_later(self._renew_every, self._renew)
