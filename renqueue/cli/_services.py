"""``up``, ``router``, ``worker``, ``exporter`` and ``provision``: the long-running
processes and their set-up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import click

from ..config import Config
from ..errors import RenQueueError
from ..logs import get_logger
from ._app import cli, command, setup
from ._common import client_url, with_nats

if TYPE_CHECKING:
    from ..services import Services

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _metrics_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--metrics-port",
        type=click.IntRange(min=0, max=65535),
        metavar="PORT",
        help="Serve this process's Prometheus metrics on 127.0.0.1:PORT (default: none).",
    )(f)


def _routers_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "--routers", type=click.IntRange(min=0), default=1, help="Router loops in this process."
    )(f)


def _backend_option(f: click.decorators.FC) -> click.decorators.FC:
    return click.option(
        "-b",
        "--backend",
        "backends",
        multiple=True,
        metavar="NAME",
        help="Run workers for this backend only (repeatable; default: every backend).",
    )(f)


@command(
    cli,
    "up",
    short_help="Run Ren-Queue: NATS (embedded unless --nats), routers, workers, the gateway.",
    epilog="Example: renqueue up --mocks",
)
@_routers_option
@_backend_option
@_metrics_option
@click.option(
    "--mocks",
    is_flag=True,
    help="Also serve a mock LLM backend on each loopback port the config's backends name "
    "(a backend elsewhere is left alone), so the config runs with no model server.",
)
@click.pass_context
def up(
    ctx: click.Context,
    routers: int,
    backends: tuple[str, ...],
    metrics_port: int | None,
    mocks: bool,
) -> None:
    """Run Ren-Queue in this process: the embedded nats-server (unless --nats
    or [nats] url names one), the streams, routers and workers, and the
    OpenAI-compatible gateway when [gateway] has API keys. Ctrl-C stops it in
    order, handing back what is in flight."""
    config = setup(ctx, service=True)
    asyncio.run(
        _run(config, "up", routers=routers, backends=list(backends) or None,
             metrics_port=metrics_port, mocks=mocks)
    )  # fmt: skip


@command(
    cli,
    "router",
    short_help="Run routers only, joining a running Ren-Queue (scale out).",
    epilog="Example: renqueue router --nats nats://10.0.0.5:4222 --routers 2",
)
@_routers_option
@_metrics_option
@click.pass_context
def router(ctx: click.Context, routers: int, metrics_port: int | None) -> None:
    """Run router loops only (no workers), joining the NATS a running Ren-Queue
    uses (--nats, [nats] url or $RENQUEUE_NATS_URL); one of them holds the
    binder's lease, the others stand by."""
    config = setup(ctx, service=True)
    asyncio.run(_run(config, "router", routers=routers, backends=[], metrics_port=metrics_port))


@command(
    cli,
    "worker",
    short_help="Run workers only, for some or all backends (scale out).",
    epilog="Example: renqueue worker -b local-llama-8b --nats nats://10.0.0.5:4222",
)
@_backend_option
@_metrics_option
@click.pass_context
def worker(ctx: click.Context, backends: tuple[str, ...], metrics_port: int | None) -> None:
    """Run workers only (no router), joining the NATS a running Ren-Queue uses:
    for the backends named with -b, or every backend of the config."""
    config = setup(ctx, service=True)
    asyncio.run(
        _run(config, "worker", routers=0, backends=list(backends) or None,
             metrics_port=metrics_port)
    )  # fmt: skip


async def _run(
    config: Config,
    command_name: str,
    *,
    routers: int,
    backends: list[str] | None,
    metrics_port: int | None,
    mocks: bool = False,
) -> None:
    from ..services import run_until_signalled

    cluster = None
    if metrics_port is not None:
        from prometheus_client import REGISTRY, start_http_server

        if routers > 0:  # it runs the projector: the cluster-wide series too
            from ..coordination import ClusterMetrics

            cluster = ClusterMetrics(config)
            REGISTRY.register(cluster)
        start_http_server(metrics_port, addr="127.0.0.1")
    if command_name != "up" and not config.nats.url:
        # Scaling out joins a running Ren-Queue; it never starts a second
        # embedded server on the same store.
        config = with_nats(config, client_url(config))
    services: Services
    if command_name == "up" and _gateway_wanted(config):
        from ..process import ServicesWithGateway

        services = ServicesWithGateway(
            config, routers=routers, backends=backends, cluster_metrics=cluster
        )
    else:
        from ..services import Services

        services = Services(config, routers=routers, backends=backends, cluster_metrics=cluster)
    async with contextlib.AsyncExitStack() as stack:
        if mocks:
            await stack.enter_async_context(_mock_backends(config))
        await run_until_signalled(services)


def mock_ports(config: Config) -> tuple[dict[int, list[str]], list[str]]:
    """The loopback ports the config's backends name (with the backends on
    each), and the backends that are elsewhere."""
    ports: dict[int, list[str]] = {}
    elsewhere = []
    for name, backend in config.backends.items():
        url = urlsplit(backend.base_url)
        if url.hostname not in _LOOPBACK:
            elsewhere.append(name)
            continue
        port = url.port or (443 if url.scheme == "https" else 80)
        ports.setdefault(port, []).append(name)
    return ports, elsewhere


@contextlib.asynccontextmanager
async def _mock_backends(config: Config) -> AsyncIterator[None]:
    """``up --mocks``: a mock LLM backend on each loopback port of the config."""
    from ..mock import MockBackend, MockSettings

    log = get_logger(__name__)
    ports, elsewhere = mock_ports(config)
    for name in elsewhere:
        log.info("--mocks: no mock for backend (not on this machine)", backend=name)
    async with contextlib.AsyncExitStack() as stack:
        for port, names in sorted(ports.items()):
            settings = MockSettings(ttft=0.05, tokens_per_second=200.0, output_tokens=24)
            try:
                mock = await stack.enter_async_context(MockBackend(settings, port=port))
            except OSError as exc:
                raise RenQueueError(
                    f"--mocks: cannot serve a mock for {', '.join(names)} on 127.0.0.1:{port}: "
                    f"{exc.strerror} (is the model server itself running? then drop --mocks)"
                ) from None
            log.info("mock backend serving", url=mock.url, backends=names)
        yield


def _gateway_wanted(config: Config) -> bool:
    """``up`` runs the gateway when it is enabled and has API keys to accept."""
    gateway = config.gateway
    if not gateway.enabled:
        return False
    if gateway.keys or gateway.keys_file:
        return True
    get_logger(__name__).info(
        "gateway not started: [gateway] has no API keys (keys or keys_file;"
        " `renqueue gateway keygen TENANT` makes one)"
    )
    return False


@command(
    cli,
    "exporter",
    short_help="Serve the cluster-wide Prometheus metrics (one scrape target).",
    epilog="Example: renqueue exporter --port 9464 --nats nats://127.0.0.1:4222",
)
@click.option("--port", type=click.IntRange(0, 65535), required=True, help="Listen on this port.")
@click.option("--host", default="127.0.0.1", help="Listen on this address.")
@click.pass_context
def exporter(ctx: click.Context, port: int, host: str) -> None:
    """Serve what the projection and the broker know of the whole cluster
    (docs/metrics.md) on http://HOST:PORT/metrics, joining a running Ren-Queue
    (--nats or RENQUEUE_NATS_URL)."""
    from ..coordination import run_exporter

    config = setup(ctx, service=True)
    asyncio.run(run_exporter(config, client_url(config), host=host, port=port))


@command(
    cli,
    "provision",
    short_help="Create or update the streams, consumers and buckets in NATS (idempotent).",
    epilog="Example: renqueue provision --nats nats://127.0.0.1:4222",
)
@click.pass_context
def provision(ctx: click.Context) -> None:
    """Apply streams/ (the streams, consumers and KV buckets) to NATS: what is
    missing is created, what differs is updated in place; nothing is lost."""
    config = setup(ctx, service=True)
    asyncio.run(_provision(config))


async def _provision(config: Config) -> None:
    from ..broker import connect
    from ..broker import provision as apply

    nc = await connect(client_url(config), name="renqueue-provision", config=config.nats)
    try:
        report = await apply(nc, config)
        click.echo(report)
    finally:
        await nc.drain()
