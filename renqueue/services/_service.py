"""Running the services: embedded NATS (when no URL is given), routers and workers.

:class:`Services` is the one place that wires them together, for ``renqueue
up``, ``renqueue router``, ``renqueue worker``, the demo and the tests. Its
shutdown order is fixed: stop taking work (routers first, so nothing new is
dispatched), let workers finish in-flight runs within ``worker.drain_timeout``
and nak the rest, drain the NATS connection, stop the embedded server.

Start-up joining a cluster that is electing its leaders (or whose nodes are
still coming up) waits for it: provisioning, and opening the projector's and
routers' state, retry while JetStream cannot answer, logging each attempt (see
:func:`renqueue.broker.until_jetstream_answers`), for up to
``nats.startup_wait`` (default: forever). A signal stops the wait.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol, TypeVar

from ..backends import make_backend
from ..backends.base import Backend
from ..broker import (
    Connection,
    ConnectionKeeper,
    EmbeddedServer,
    JetStream,
    connect,
    provision,
    redact_url,
    until_jetstream_answers,
)
from ..config import Config, parse_duration
from ..coordination import CancelWatch, ClusterMetrics, Exporter, Projector
from ..errors import ServiceFailedError
from ..lifecycle import Lifecycle, State
from ..logs import get_logger
from ..tasks import Fatal, Supervisor, cancel_and_wait
from ._advisories import AdvisoryReader
from .router import Router
from .worker import Worker

__all__ = ["Services", "State", "run_until_signalled"]

log = get_logger("service")

#: The loop that keeps the services on a live connection.
_WATCH: Final = "nats-connection"
#: The loop that stops the services when their embedded nats-server ends.
_SERVER: Final = "embedded-nats-server"


class _Startable(Protocol):
    async def start(self) -> None: ...
    async def close(self) -> None: ...


_S = TypeVar("_S", bound=_Startable)


class Services(Lifecycle):
    """Start what this process should run; stop it all in order on exit.

    ``backends=None`` runs a worker for every configured backend; ``[]`` none.
    ``projector=None`` runs the projection service when routers run here.
    ``cluster_metrics``: fed with the cluster-wide series where the projector runs.
    """

    def __init__(
        self,
        config: Config,
        *,
        routers: int = 1,
        backends: Sequence[str] | None = None,
        provision_streams: bool = True,
        projector: bool | None = None,
        name: str = "renqueue",
        cluster_metrics: ClusterMetrics | None = None,
    ) -> None:
        self.config = config
        self._router_count = routers
        self._backend_names = list(config.backends) if backends is None else list(backends)
        self._provision = provision_streams
        # The projection is folded wherever routers run, unless told otherwise;
        # any number of projectors may run (they compare-and-set the state).
        self._run_projector = routers > 0 if projector is None else projector
        self._name = name
        self.server: EmbeddedServer | None = None
        self.nc: Connection | None = None
        self.js: JetStream | None = None
        self.projector: Projector | None = None
        #: Fed by :attr:`exporter` where the projector runs (``renqueue up --metrics-port``).
        self._cluster_metrics = cluster_metrics
        self.exporter: Exporter | None = None
        self.cancels: CancelWatch | None = None
        #: Ends requests that ran out of deliveries; runs wherever routers or workers do.
        self.advisories: AdvisoryReader | None = None
        self.routers: list[Router] = []
        self.workers: list[Worker] = []
        self._adapters: list[Backend] = []
        #: Owns every background loop of this process; ``failed`` is set when one
        #: cannot go on, and the process must then stop (see :mod:`renqueue.tasks`).
        self.supervisor = Supervisor(name, broker_patience=config.nats.patience_seconds)
        #: Keeps the services on a live connection (see :meth:`_renew`).
        self.keeper: ConnectionKeeper | None = None

    @property
    def state(self) -> State:
        """Where the services are in their lifecycle (the same as :attr:`status`)."""
        return self.status

    @property
    def url(self) -> str:
        if self.config.nats.url:
            return self.config.nats.url
        if self.server is None:
            raise RuntimeError("services are not running")
        return self.server.url

    async def _start(self) -> None:
        # A failure (or a cancellation) here stops what was opened: see Lifecycle.start.
        # Everything that can be checked is checked before anything starts.
        self._check()
        if not self.config.nats.url:
            nats = self.config.nats
            self.server = EmbeddedServer(
                Path(nats.data_dir),
                host=nats.host,
                port=nats.port,
                max_file_store=nats.store_bytes,
            )
            await self.server.start()
            log.info("embedded nats-server started", url=self.server.url)
            self.supervisor.spawn(_SERVER, functools.partial(_outlive_not, self.server))
        self.nc = nc = await connect(self.url, name=self._name, config=self.config.nats)
        self.js = nc.jetstream()
        if self._provision:
            await provision(nc, self.config)
        await self._start_components()
        self.keeper = ConnectionKeeper(
            url=self.url,
            name=self._name,
            config=self.config.nats,
            current=lambda: self.nc,
            renew=self._renew,
        )
        self.supervisor.spawn(_WATCH, self.keeper.run)

    async def _start_components(self) -> None:
        """Start what runs on the connection (:attr:`nc`), in order."""
        nc, js = self.nc, self.js
        if nc is None or js is None:
            raise RuntimeError("not connected")
        self.cancels = CancelWatch(js, supervisor=self.supervisor)
        await self.cancels.start()
        if self._run_projector:
            self.projector = await self._start_waiting(
                "projector",
                functools.partial(
                    Projector,
                    js,
                    name=f"{self._name}-projector",
                    supervisor=self.supervisor,
                ),
            )
        if self.projector is not None and self._cluster_metrics is not None:
            self.exporter = Exporter(
                js, self._cluster_metrics, supervisor=self.supervisor, name=f"{self._name}-exporter"
            )
            await self.exporter.start()
        for index in range(self._router_count):
            router = await self._start_waiting(
                f"router {index}",
                functools.partial(
                    Router,
                    nc,
                    js,
                    self.config,
                    name=f"{self._name}-router-{index}",
                    cancels=self.cancels,
                    supervisor=self.supervisor,
                ),
            )
            self.routers.append(router)
        for backend_name, adapter in zip(self._backend_names, self._adapters, strict=True):
            worker = Worker(
                nc,
                js,
                self.config,
                backend_name,
                adapter,
                cancels=self.cancels,
                supervisor=self.supervisor,
            )
            await worker.start()
            self.workers.append(worker)
        if self.routers or self.workers:
            self.advisories = AdvisoryReader(js, supervisor=self.supervisor)
            await self.advisories.start()

    async def _start_waiting(self, step: str, make: Callable[[], _S]) -> _S:
        """``make()`` and start it; while JetStream cannot answer, stop it and
        try a fresh one (each attempt starts from nothing)."""

        async def attempt() -> _S:
            component = make()
            await component.start()  # a failed start has stopped the component
            return component

        patience = parse_duration(self.config.nats.startup_wait)
        if self.nc is None:
            raise RuntimeError("not connected")
        return await until_jetstream_answers(step, attempt, nc=self.nc, patience=patience)

    def _check(self) -> None:
        """Check the config and build the backend adapters, before NATS is touched.

        A backend whose API key is missing is taken out of service (out of
        every route this process routes, and no worker for it) with one
        warning, so the rest runs; a ``required`` one raises ConfigError.
        """
        unusable = self.config.unusable_backends(self._backend_names)
        for name, error in unusable.items():
            log.warning(
                "backend taken out of service: its API key is missing "
                "(set it, or mark the backend required = true to make this an error)",
                backend=name,
                error=str(error),
            )
        if unusable:
            self.config = self.config.without_backends(unusable)
            self._backend_names = [n for n in self._backend_names if n not in unusable]
        if self._router_count and not self.config.routes:
            log.warning("no routes configured: every request will be rejected (unknown_route)")
        if not self.config.backends:
            log.warning("no backends configured: nothing can serve a request")
        for backend_name in self._backend_names:
            # Each adapter owns connection pools sized to its concurrency.
            backend = self.config.backends[backend_name]
            adapter = make_backend(backend_name, backend)
            self._adapters.append(adapter)

    async def _close(self) -> None:
        """The embedded server is stopped whatever happens before (an error, a
        cancellation): it never outlives us."""
        try:
            await self._close_services()
        finally:
            if self.server is not None:
                await self.server.close()

    async def _close_components(self) -> None:
        """Stop what runs on the connection, in order, and forget it."""
        for router in self.routers:
            await router.close()
        await asyncio.gather(*(worker.close() for worker in self.workers), return_exceptions=True)
        if self.advisories is not None:
            await self.advisories.close()
        if self.exporter is not None:
            await self.exporter.close()
        if self.projector is not None:
            await self.projector.close()  # after the workers: their last events get folded
        if self.cancels is not None:
            await self.cancels.close()
        self.routers, self.workers = [], []
        self.advisories = self.projector = self.cancels = None
        self.exporter = None

    async def _renew(self, new: Connection) -> None:
        """The server closed the connection (see :class:`ConnectionKeeper`):
        stop every component on it and start them again on ``new``, each
        rebuilding what it needs from the log and the projection, as a
        restarted process would (a worker's runs in flight run again: their
        messages were never acked)."""
        for worker in self.workers:
            worker.abandon_runs()
        await self._close_components()
        self.nc, self.js = new, new.jetstream()
        await self._start_components()

    async def _close_services(self) -> None:
        """Everything but the embedded server, in order."""
        await self.supervisor.cancel(_WATCH)
        await self._close_components()
        for adapter in self._adapters:
            await adapter.close()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception as exc:  # noqa: BLE001 - shutting down regardless
                log.warning("nats drain failed", error=str(exc))
        await self.supervisor.close()


async def _outlive_not(server: EmbeddedServer) -> None:
    """Fail the services (the process stops, non-zero) when their embedded
    nats-server ends: nothing else would bring it back, and every connection
    would retry a dead port for ever. Cancelled first on a shutdown, which
    stops the server after every other service."""
    pid = server.pid
    status = await server.exited()
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    raise Fatal(
        f"the embedded nats-server (pid {pid}) {how}: nothing can run without it; "
        "start `renqueue up` again"
    )


async def run_until_signalled(services: Services) -> None:
    """Run until SIGINT or SIGTERM, or until a background loop cannot go on;
    then shut down in order. Raises :class:`ServiceFailedError` in the second
    case, after the shutdown, so the process exits non-zero."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if not await _start_unless_signalled(services, stop) or stop.is_set():
            await services.close()
            log.info("signal received while starting; stopped")
            return
        try:
            log.info("running; Ctrl-C to stop", url=redact_url(services.url))
            signalled = asyncio.create_task(stop.wait())
            failed = asyncio.create_task(services.supervisor.failed.wait())
            try:
                await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait([signalled, failed])
            if services.supervisor.failed.is_set():
                log.critical("a service loop failed; draining", reason=services.supervisor.reason)
            else:
                log.info("signal received; draining")
        finally:
            await services.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if services.supervisor.failed.is_set():
        raise ServiceFailedError(services.supervisor.reason or "a service loop failed")


async def _start_unless_signalled(services: Services, stop: asyncio.Event) -> bool:
    """Start ``services``, or stop starting once ``stop`` is set (start-up can
    wait long for a cluster): False then. A failed start raises; either way
    start() has closed what it opened."""
    starting = asyncio.create_task(services.start())
    signalled = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([signalled])
        if not starting.done():
            # Once: start() then closes what it opened; a second cancel would cut that short.
            starting.cancel()
            await asyncio.wait({starting})
    if starting.cancelled():
        return False
    starting.result()  # raises what start() raised
    return True
