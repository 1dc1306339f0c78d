"""The one lifecycle (issue #7 item 5): every component starts once, stops
idempotently, works as ``async with``, ends CLOSED when its start fails, and
removes the listeners it registered when it stops. Against a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from renqueue import Services, parse_config
from renqueue.backends import make_backend
from renqueue.broker import Connection, EmbeddedServer
from renqueue.config import Config
from renqueue.coordination import Projector, StateView
from renqueue.coordination._cancellation import CancelWatch
from renqueue.errors import NatsNotFoundError
from renqueue.lifecycle import Lifecycle, State
from renqueue.services import AdvisoryReader
from renqueue.services.router import Router
from renqueue.services.worker import Worker


def make_config(url: str) -> Config:
    return parse_config(
        {
            "nats": {"url": url},
            # Never called: nothing is submitted.
            "backends": {"b": {"base_url": "http://127.0.0.1:9", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"drain_timeout": "1s"},
        }
    )


@pytest.fixture
async def stack(isolated_server: EmbeddedServer) -> AsyncIterator[Services]:
    """Provisioned streams and a connection, and no services of its own."""
    async with Services(make_config(isolated_server.url), routers=0, backends=[]) as services:
        yield services


Factory = Callable[[Services], Lifecycle]


def _router(s: Services) -> Lifecycle:
    return Router(s.nc, s.js, s.config, name="r", cancels=s.cancels)


def _worker(s: Services) -> Lifecycle:
    adapter = make_backend("b", s.config.backends["b"])
    return Worker(s.nc, s.js, s.config, "b", adapter, name="w", cancels=s.cancels)


FACTORIES: dict[str, Factory] = {
    "router": _router,
    "worker": _worker,
    "projector": lambda s: Projector(s.js, name="p"),
    "state-view": lambda s: StateView(s.js),
    "cancel-watch": lambda s: CancelWatch(s.js),
    "advisories": lambda s: AdvisoryReader(s.js),
}


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_starting_twice_raises_and_stopping_twice_is_fine(stack: Services, kind: str) -> None:
    component = FACTORIES[kind](stack)
    assert component.status is State.UNOPENED
    await component.start()
    assert component.status is State.RUNNING
    with pytest.raises(RuntimeError, match=r"cannot start .*: it is running"):
        await component.start()
    await component.close()
    assert component.status is State.CLOSED
    await component.close()
    assert component.status is State.CLOSED
    with pytest.raises(RuntimeError, match="it is closed"):
        await component.start()


@pytest.mark.parametrize("kind", list(FACTORIES))
async def test_async_with_starts_and_stops(stack: Services, kind: str) -> None:
    component = FACTORIES[kind](stack)
    async with component as running:
        assert running is component
        assert component.status is State.RUNNING
    assert component.status is State.CLOSED


async def test_stop_of_an_unopened_component_just_closes_it(stack: Services) -> None:
    component = _router(stack)
    await component.close()
    assert component.status is State.CLOSED
    with pytest.raises(RuntimeError):
        await component.start()


async def test_services_start_twice_raises_and_close_is_idempotent(
    isolated_server: EmbeddedServer,
) -> None:
    services = Services(make_config(isolated_server.url), routers=0, backends=[])
    async with services:
        assert services.state is State.RUNNING
        with pytest.raises(RuntimeError, match="Services 'renqueue': it is running"):
            await services.start()
    assert services.state is State.CLOSED
    await services.close()
    await services.close()
    assert services.status is State.CLOSED


@pytest.mark.parametrize("kind", ["router", "worker"])
async def test_a_stopped_router_or_worker_leaves_no_cancel_listener(
    stack: Services, kind: str
) -> None:
    watch = stack.cancels
    assert watch is not None
    before = watch.listeners
    component = FACTORIES[kind](stack)
    async with component:
        assert watch.listeners == before + 1
    assert watch.listeners == before


async def test_unlisten_removes_the_listener_once(stack: Services) -> None:
    watch = stack.cancels
    assert watch is not None
    before = watch.listeners
    unlisten = watch.listen(lambda _event: None)
    assert watch.listeners == before + 1
    unlisten()
    unlisten()
    assert watch.listeners == before


def _unprovisioned(nc: Connection) -> dict[str, Callable[[], Lifecycle]]:
    """Components whose start fails: the server has no streams or buckets."""
    js = nc.jetstream(timeout=1.0)
    config = make_config("nats://unused")
    return {
        "projector": lambda: Projector(js, name="p"),
        "state-view": lambda: StateView(js),
        "router": lambda: Router(nc, js, config, name="r"),
    }


@pytest.mark.parametrize("kind", ["projector", "state-view", "router"])
async def test_a_failed_start_ends_closed_and_stops_again_quietly(
    isolated_nc: Connection, kind: str
) -> None:
    component = _unprovisioned(isolated_nc)[kind]()
    with pytest.raises(NatsNotFoundError):  # the rq-state bucket
        await component.start()
    assert component.status is State.CLOSED
    await component.close()
    assert component.status is State.CLOSED


async def test_a_failing_start_is_stopped_once() -> None:
    calls: list[str] = []

    class Broken(Lifecycle):
        async def _start(self) -> None:
            calls.append("start")
            raise OSError("no")

        async def _close(self) -> None:
            calls.append("stop")

    broken = Broken()
    with pytest.raises(OSError, match="no"):
        async with broken:
            pytest.fail("the body runs only after a start")
    await broken.close()
    assert calls == ["start", "stop"]
    assert broken.status is State.CLOSED


async def test_a_worker_whose_start_fails_removes_its_listener(
    stack: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch = stack.cancels
    assert watch is not None
    before = watch.listeners
    worker = _worker(stack)

    async def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise OSError("consumer gone")

    monkeypatch.setattr(stack.js, "pull_subscribe_bind", refuse)
    with pytest.raises(OSError, match="consumer gone"):
        await worker.start()
    assert worker.status is State.CLOSED
    assert watch.listeners == before
