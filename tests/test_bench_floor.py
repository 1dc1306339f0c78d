"""The floor of ``bench/pipeline.py`` (``bench/_floor.py``), its parts on their own: the
optional ``claim`` variant does Ren-Queue's terminal claim (a sixth stored message a
request, in a bucket of its own), ``--procs`` starts as many floor workers a variant as
the deployed shape has, and the wait for the pipeline's processes to be idle before the
floor ends once they are. Real nats-server, real mock; no timing is checked here."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from _waits import until

from renqueue.broker import EmbeddedServer, connect
from renqueue.mock import MockBackend, MockSettings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Iterator[tuple[ModuleType, ModuleType]]:
    """``bench/_floor.py`` and ``bench/pipeline.py``, imported as the bench imports them
    (``bench/`` first on the path: ``pipeline`` imports ``_floor``, ``chaos``, ``common``)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        yield importlib.import_module("_floor"), importlib.import_module("pipeline")
    finally:
        sys.path.remove(str(REPO / "bench"))


async def test_the_claim_variant_claims_each_request_before_its_completed(
    bench: tuple[ModuleType, ModuleType], isolated_server: EmbeddedServer
) -> None:
    floor, _ = bench
    nc = await connect(isolated_server.url, name="floor")
    client_nc = await connect(isolated_server.url, name="floor-client")
    try:
        async with (
            MockBackend(MockSettings(output_tokens=floor.OUTPUT_TOKENS)) as mock,
            floor.in_process(nc, mock.url, 16, (floor.CLAIM,)) as services,
        ):
            client = floor.FloorClient(client_nc)
            await client.start()
            try:
                before = await floor.stored(nc)
                for _ in range(3):
                    await client.call(floor.CLAIM)
                after = await floor.stored(nc)
            finally:
                await client.close()
            assert {name: after[name] - before[name] for name in after} == {
                floor.REQUESTS: 3,
                floor.DISPATCH: 3,
                floor.EVENTS: 9,
                floor.CLAIMS: 3,  # the sixth stored message, as rq-terminal's
            }
            assert all(tasks.errors == 0 for tasks in services.values())
    finally:
        await client_nc.close()
        await nc.close()


async def test_the_plain_variants_store_no_claim(
    bench: tuple[ModuleType, ModuleType], isolated_server: EmbeddedServer
) -> None:
    floor, _ = bench
    nc = await connect(isolated_server.url, name="floor")
    client_nc = await connect(isolated_server.url, name="floor-client")
    try:
        async with (
            MockBackend(MockSettings(output_tokens=floor.OUTPUT_TOKENS)) as mock,
            floor.in_process(nc, mock.url, 16) as services,
        ):
            client = floor.FloorClient(client_nc)
            await client.start()
            try:
                before = await floor.stored(nc)
                for variant in floor.VARIANTS:
                    await client.call(variant)
                after = await floor.stored(nc)
            finally:
                await client.close()
            assert after[floor.CLAIMS] == before[floor.CLAIMS]
            assert after[floor.EVENTS] - before[floor.EVENTS] == 3 * len(floor.VARIANTS)
            assert all(tasks.errors == 0 for tasks in services.values())
    finally:
        await client_nc.close()
        await nc.close()


@pytest.mark.timeout(120)
async def test_procs_starts_as_many_floor_workers_a_variant_as_the_shape(
    bench: tuple[ModuleType, ModuleType], isolated_server: EmbeddedServer, tmp_path: Path
) -> None:
    floor, pipeline = bench
    nc = await connect(isolated_server.url, name="floor-client")
    try:
        await floor.provision(nc, 16)
        async with (
            MockBackend(MockSettings(output_tokens=floor.OUTPUT_TOKENS)) as mock,
            pipeline.floor_processes(
                isolated_server.url, mock.url, 16, tmp_path, variants=("aiohttp",), workers=2
            ) as pids,
        ):
            assert set(pids) == {
                "floor-router",
                "floor-worker-aiohttp-0",
                "floor-worker-aiohttp-1",
            }
            client = floor.FloorClient(nc)
            await client.start()
            try:
                for _ in range(4):
                    await client.call("aiohttp")
            finally:
                await client.close()
            js = nc.jetstream()

            async def all_acked() -> bool:
                # A worker acks its dispatch after `completed` is stored, which the
                # client may have read first: wait for the last ack, not a sleep.
                info = await js.consumer_info(floor.DISPATCH, floor.worker_consumer("aiohttp"))
                return info.num_ack_pending == 0 and info.num_pending == 0

            await until(all_acked, "every dispatch is acked by a floor worker")
    finally:
        await nc.close()


async def test_settle_ends_once_the_processes_are_idle(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, pipeline = bench
    # This process, waiting in the settle's sleep, uses next to nothing: the first
    # window ends it, well before the bound.
    waited = await pipeline.settle({"me": os.getpid()}, {"me": 0.0}, most=60.0)
    assert waited < 60.0
