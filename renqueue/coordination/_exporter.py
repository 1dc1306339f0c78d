"""The cluster-wide metrics exporter: one scrape target for the whole cluster.

Two parts:

- :class:`ClusterMetrics`, a Prometheus collector (register it on a
  ``CollectorRegistry``; one per process). A scrape shows the series of
  :data:`~renqueue.coordination._cluster.SERIES` from the latest
  :class:`~renqueue.coordination._cluster.ClusterReading`, read again when the
  one it has is older than ``max_age`` (1 s): scrapes within that share one
  read. A read that fails or takes longer than ``patience`` (2 s: a broker
  that is gone) leaves the last values in place, with ``renqueue_exporter_up``
  0: a scrape never waits on a dead broker longer than that. It also holds the
  two histograms of completed calls' time to first token and duration.
- :class:`Exporter`, the component that feeds it on one NATS connection: it
  reads the cluster when a scrape asks, and follows the event log's
  ``completed`` events from the newest on (an ephemeral consumer: it never
  replays the log) into the histograms, whichever process ran the call.

``renqueue exporter --port P`` runs both in a process of its own
(:func:`run_exporter`); ``renqueue up --metrics-port P`` adds them to its
per-process metrics when it runs the projector.

Prometheus's HTTP server scrapes from a thread of its own: the collector then
waits (``patience`` at most) for the read it asks the event loop for. A scrape
on the event loop's own thread (the gateway's ``/metrics``) never waits: it
shows the values it has and asks for fresh ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Final
from wsgiref.simple_server import WSGIServer

import msgspec
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..broker import (
    AckPolicy,
    Connection,
    ConnectionKeeper,
    ConsumerConfig,
    DeliverPolicy,
    JetStream,
    Message,
    PullSubscription,
    connect,
    delete_consumer,
    redact_url,
    subject_agrees,
)
from ..config import Config
from ..errors import ConfigError, NatsError, ServiceFailedError
from ..lifecycle import Lifecycle
from ..logs import get_logger
from ..schema import EVENT_DECODER, EVENTS_STREAM, FETCH_TIMEOUT, Completed
from ..tasks import Supervisor, cancel_and_wait
from ._cluster import SERIES, ClusterReading, cluster_families, out_of_service, read_cluster

__all__ = ["ClusterMetrics", "Exporter", "run_exporter"]

log = get_logger("exporter")

#: The events the histograms are fed from.
COMPLETIONS: Final = "rq.evt.*.*.completed"
#: Name of the exporter's loop under its supervisor.
LOOP: Final = "exporter-tail"
#: Time-to-first-token buckets (seconds): local models answer in tens of ms,
#: cloud APIs in hundreds, a loaded one in seconds.
TTFT_BUCKETS: Final = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
#: Call duration buckets (seconds): from a short answer to a long generation.
DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Messages fetched at once by the tail.
_BATCH: Final = 256
#: Empty fetches in a row after which the tail checks its consumer still exists.
_IDLE_CHECK: Final = 5
#: The tail's consumer goes away this long after its process stopped asking.
_INACTIVE: Final = 30.0
#: How long :meth:`Exporter.start` waits for the tail to be in place.
_TAIL_READY: Final = 10.0

Reader = Callable[[], Awaitable[ClusterReading]]


class ClusterMetrics(Collector):
    """The cluster series for Prometheus (see the module docstring).

    ``config`` names the levels, backends, routes and budgets; a backend
    whose API key cannot be read here is shown down (out of service).
    ``max_age``: how long a reading serves scrapes; ``patience``: the longest
    a scrape waits for a new one.
    """

    def __init__(
        self,
        config: Config,
        *,
        max_age: float = 1.0,
        patience: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.max_age = max_age
        self.patience = patience
        self._clock = clock
        self._out = out_of_service(config)
        self._reading: ClusterReading | None = None
        self._up = False
        #: The last binder's term seen (kept while no one holds the lease).
        self._term = 0
        #: Binding split in groups: each group's last binder term seen.
        self._group_terms: dict[str, int] = {}
        #: When a read last ended (``clock`` time), well or not.
        self._tried_at = -float("inf")
        self._failing = False
        self._reader: Reader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._pending: asyncio.Task[None] | None = None
        self.ttft = Histogram(
            "renqueue_backend_ttft_seconds",
            _help("renqueue_backend_ttft_seconds"),
            ["backend"],
            buckets=TTFT_BUCKETS,
            registry=None,
        )
        self.duration = Histogram(
            "renqueue_backend_duration_seconds",
            _help("renqueue_backend_duration_seconds"),
            ["backend"],
            buckets=DURATION_BUCKETS,
            registry=None,
        )

    @property
    def reading(self) -> ClusterReading | None:
        """The latest reading (``None``: none yet)."""
        return self._reading

    @property
    def up(self) -> bool:
        """Whether the latest read succeeded."""
        return self._up

    def attach(self, reader: Reader) -> None:
        """Read the cluster with ``reader`` from now on, on the running event loop."""
        self._reader = reader
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()

    def detach(self, reader: Reader) -> None:
        """Stop reading with ``reader`` (if it is the one attached); the last values stay."""
        if self._reader is reader:
            self._reader = None
            self._up = False

    def observe(self, event: Completed) -> None:
        """Count one completed call in the histograms (a backend the config names)."""
        if event.backend not in self.config.backends or event.shared_with is not None:
            return  # an unknown name is no label; a shared call was counted with its leader
        if event.ttft is not None and event.ttft >= 0:
            self.ttft.labels(event.backend).observe(event.ttft)
        if event.duration >= 0:
            self.duration.labels(event.backend).observe(event.duration)

    # ------------------------------------------------------------- reading

    def _fresh(self) -> bool:
        return self._clock() - self._tried_at < self.max_age

    async def refresh(self) -> None:
        """Read the cluster again unless a read ended within ``max_age``; never
        longer than ``patience``. Runs on the event loop it was attached on."""
        if self._fresh() or self._lock is None:
            return
        async with self._lock:
            reader = self._reader
            if self._fresh() or reader is None:
                return
            try:
                async with asyncio.timeout(self.patience):
                    reading = await reader()
            except Exception as exc:  # noqa: BLE001 - a scrape never fails: it shows the last
                self._failed(exc)
            else:
                self._read(reading)
            finally:
                self._tried_at = self._clock()

    def _read(self, reading: ClusterReading) -> None:
        self._reading = reading
        self._up = True
        if reading.binder is not None:
            self._term = reading.binder.term
        for group, holder in reading.groups:
            if holder is not None:
                self._group_terms[group] = holder.term
        if self._failing:
            log.info("reading the cluster again")
        self._failing = False

    def _failed(self, exc: BaseException) -> None:
        self._up = False
        if not self._failing:  # once per streak, not at every scrape
            log.warning(
                "cannot read the cluster; serving the last values",
                error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
            )
        self._failing = True

    def _refresh_for_scrape(self) -> None:
        """Called by a scrape: wait for a fresh reading from another thread; on
        the loop's own thread, ask for one and show what there is."""
        loop = self._loop
        if loop is None or self._fresh() or loop.is_closed():
            return
        if _running_loop() is loop:
            if self._pending is None or self._pending.done():
                self._pending = loop.create_task(self.refresh())
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self.refresh(), loop)
        except RuntimeError:
            return  # the loop is closing
        with contextlib.suppress(concurrent.futures.TimeoutError):
            future.result(timeout=self.patience + 0.5)

    # ---------------------------------------------------------- collecting

    def collect(self) -> Iterable[Metric]:
        self._refresh_for_scrape()
        yield from cluster_families(
            self._reading,
            self.config,
            up=self._up,
            term=self._term,
            out=self._out,
            group_terms=self._group_terms,
        )
        yield from self.ttft.collect()
        yield from self.duration.collect()

    def describe(self) -> Iterable[Metric]:
        """Every family's name, without reading the cluster (for registration)."""
        yield from cluster_families(None, self.config, up=False, term=0)
        yield from self.ttft.describe()
        yield from self.duration.describe()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _help(name: str) -> str:
    (series,) = (series for series in SERIES if series.name == name)
    return series.help


class Exporter(Lifecycle):
    """Feeds ``metrics`` from one connection (``js``): reads the cluster when a
    scrape asks, and follows completed calls into its histograms.

    ``supervisor`` runs the tail loop (a private one when ``None``). One
    exporter is attached to ``metrics`` at a time; a new one (on a new
    connection) takes over from the last.
    """

    def __init__(
        self,
        js: JetStream,
        metrics: ClusterMetrics,
        *,
        supervisor: Supervisor | None = None,
        name: str = "exporter",
    ) -> None:
        self._js = js
        self._metrics = metrics
        self._name = name
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor(name)
        self._loop_name = f"{LOOP}-{name}"
        #: Stream sequence the tail resumes from after a failure (0: not started yet).
        self._next_seq = 0
        self._tailing = asyncio.Event()

    async def read(self) -> ClusterReading:
        """The cluster now, read on this exporter's connection."""
        return await read_cluster(self._js, self._metrics.config)

    async def _start(self) -> None:
        self._supervisor.spawn(self._loop_name, self._tail)
        waiting = asyncio.create_task(self._tailing.wait())
        failed = asyncio.create_task(self._supervisor.failed.wait())
        try:
            await asyncio.wait(
                {waiting, failed}, timeout=_TAIL_READY, return_when="FIRST_COMPLETED"
            )
        finally:
            await cancel_and_wait([waiting, failed])
        if not self._tailing.is_set():
            log.warning("the exporter's tail of the log is not in place yet; going on")
        self._metrics.attach(self.read)

    async def _close(self) -> None:
        self._metrics.detach(self.read)
        await self._supervisor.cancel(self._loop_name)
        if self._own_supervisor:
            await self._supervisor.close()

    async def _subscribe(self) -> PullSubscription:
        if not self._next_seq:
            # The newest on, but as a sequence: a tail started again after a
            # failure resumes there, not at whatever is newest by then.
            self._next_seq = (await self._js.stream_info(EVENTS_STREAM)).state.last_seq + 1
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._next_seq
        )
        config.ack_policy = AckPolicy.NONE
        config.inactive_threshold = _INACTIVE
        config.mem_storage = True
        config.num_replicas = 1
        return await self._js.pull_subscribe(COMPLETIONS, stream=EVENTS_STREAM, config=config)

    async def _tail(self) -> None:
        """Follow completed calls until stopped; raise (to be restarted) on a failure,
        to resume after the last event read."""
        psub = await self._subscribe()
        self._tailing.set()
        try:
            idle = 0
            while True:
                try:
                    msgs = await psub.fetch(batch=_BATCH, timeout=FETCH_TIMEOUT)
                except TimeoutError:
                    # A fetch from a consumer the server lost (a restart of the
                    # node holding it) times out too: look now and then, and
                    # raise if it is gone, to be started again where it was.
                    idle += 1
                    if idle % _IDLE_CHECK == 0:
                        await psub.consumer_info()
                    continue
                idle = 0
                for msg in msgs:
                    self._take(msg)
                    self._next_seq = msg.metadata.sequence.stream + 1
        finally:
            with contextlib.suppress(NatsError):
                await psub.unsubscribe()
            await delete_consumer(self._js, EVENTS_STREAM, psub.consumer)

    def _take(self, msg: Message) -> None:
        try:
            event = EVENT_DECODER.decode(msg.data)
        except msgspec.DecodeError:
            return  # not an event: nothing to count
        if isinstance(event, Completed) and subject_agrees(msg.subject, event):
            self._metrics.observe(event)


async def run_exporter(config: Config, url: str, *, host: str, port: int) -> None:
    """``renqueue exporter``: serve the cluster series on ``host:port`` until
    SIGINT or SIGTERM.

    Raises :class:`~renqueue.errors.ConnectionFailedError` when NATS cannot be
    reached at first, ``OSError`` when the port is taken, and
    :class:`~renqueue.errors.ServiceFailedError` when its connection cannot be
    kept (NATS unreachable for longer than ``nats.patience``).
    """
    metrics = ClusterMetrics(config)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(metrics)
    try:  # the port first: a port it cannot have fails at once, NATS or not
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"the exporter cannot listen on {host}:{port}: {exc.strerror or exc}", path="--port"
        ) from exc
    supervisor = Supervisor("exporter", broker_patience=config.nats.patience_seconds)
    try:
        nc = await connect(url, name="renqueue-exporter", config=config.nats)
    except BaseException:
        await asyncio.to_thread(_stop_server, server, thread)
        raise
    exporter = Exporter(nc.jetstream(), metrics, supervisor=supervisor)

    async def renew(new: Connection) -> None:
        nonlocal nc, exporter
        await exporter.close()
        nc, exporter = new, Exporter(new.jetstream(), metrics, supervisor=supervisor)
        await exporter.start()

    keeper = ConnectionKeeper(
        url=url, name="renqueue-exporter", config=config.nats, current=lambda: nc, renew=renew
    )
    try:
        await exporter.start()
        supervisor.spawn("nats-connection", keeper.run)
        log.info(
            "exporter serving the cluster's metrics",
            address=f"http://{host}:{server.server_port}/metrics",
            nats=redact_url(url),
        )
        await _until_signalled(supervisor)
    finally:
        await asyncio.to_thread(_stop_server, server, thread)
        await exporter.close()
        await supervisor.close()
        await nc.close()
    if supervisor.failed.is_set():
        raise ServiceFailedError(supervisor.reason or "the exporter's connection failed")


async def _until_signalled(supervisor: Supervisor) -> None:
    """Return on SIGINT or SIGTERM, or once a supervised loop cannot go on."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    signalled = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(supervisor.failed.wait())
    try:
        await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([signalled, failed])
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _stop_server(server: WSGIServer, thread: threading.Thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
