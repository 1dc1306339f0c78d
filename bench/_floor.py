"""The floor of ``bench/pipeline.py``: Ren-Queue's durable steps per request and nothing else.

A skeleton pipeline that stores the same five messages a request as the closed loop of
the pipeline (docs/architecture.md, *Stored messages of a request*), on streams of its
own beside Ren-Queue's (the same storage, retention and duplicate window), through the
project's broker layer (``renqueue.broker``: its ``Connection``, ``publish_async``,
``fetch`` and ``ack``, the cheapest JetStream calls we have on nats-py), and none of
Ren-Queue's logic: no schema beyond fixed bytes, no policy, no fold, no quota, no
claims, no metrics, no logs.

- client: an acked publish of the request on ``fl.req.normal.bench.<variant>`` (the
  shape of ``rq.req.<priority>.<tenant>.<route>``), its id as the message id; then the
  wait for its ``completed`` event through one push consumer filtered on that kind
  (as ``renqueue.Client``'s tap follows each terminal kind);
- router: pull-fetches requests (up to 64 at a time, as ``router.fetch_batch``), and for
  each, in a task of its own, publishes one event (``submitted``) and the dispatch
  (``fl.dispatch.<variant>``) with their acks awaited together, then acks the request;
- worker (one per HTTP client variant): pull-fetches dispatches, as many as it has free
  slots (as ``renqueue/services/worker/_worker.py``), and for each, in a task: publishes
  ``started`` without awaiting its ack, calls the mock over HTTP (streamed, the same
  body as the pipeline's), awaits ``started``'s ack, publishes ``completed`` (acked, at
  most one per subject as the event log stores a terminal event), acks the dispatch.

The HTTP call comes in two variants: ``adapter`` (the project's OpenAI adapter, httpx's
API on the aiohttp transport: what a worker calls) and ``aiohttp`` (a bare aiohttp
session reading the SSE lines).

Left out of both, and done by Ren-Queue for every request: the terminal claim. Ren-Queue's
binder looks up each fetched request's claim (one direct get a request, a batch's sent
together: ``services/router/_intake.py``), its worker looks it up again before the call
(``services/worker/_gate.py``) and creates it (an acked write to the ``rq-terminal`` KV
bucket, a sixth stored message) before publishing ``completed``
(``broker/_eventlog.py``'s ``finish``): three more round trips a request, one of them
awaited by the binder, two by the worker. The optional variant ``claim``
(``bench/pipeline.py --floor-claim``) is ``adapter`` with those three, on a bucket of
its own (``floor-terminal``, configured as ``rq-terminal``).

In ``bench/pipeline.py``'s one-process mode the three run as tasks in the bench's
process; in ``--procs`` the router and each worker are processes of their own, started
from this file (``python bench/_floor.py router|worker ...``), each printing ``ready``
once its consumer is bound and leaving on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import msgspec
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from renqueue import parse_config
from renqueue.backends import make_backend
from renqueue.backends.base import Backend
from renqueue.broker import (
    AckPolicy,
    Connection,
    DeliverPolicy,
    JetStream,
    Message,
    connect,
)
from renqueue.errors import NatsNotFoundError
from renqueue.schema import REQUEST_DECODER, InferenceRequest

REQUESTS = "FLOOR_REQUESTS"
DISPATCH = "FLOOR_DISPATCH"
EVENTS = "FLOOR_EVENTS"
#: The terminal claims' bucket of the ``claim`` variant (as ``rq-terminal``).
CLAIMS_BUCKET = "floor-terminal"
CLAIMS = f"KV_{CLAIMS_BUCKET}"
STREAMS = (REQUESTS, DISPATCH, EVENTS, CLAIMS)
ROUTER_CONSUMER = "floor-router"
#: The HTTP client variants of the worker's call (measured by default).
VARIANTS = ("adapter", "aiohttp")
#: The ``adapter`` variant with Ren-Queue's terminal claim (module docstring): optional.
CLAIM = "claim"
ALL_VARIANTS = (*VARIANTS, CLAIM)
TENANT = "bench"
BACKEND = "mock"
PROMPT = "Say something short."
#: Tokens the instant mock answers with.
OUTPUT_TOKENS = 8
#: As Ren-Queue's: ``router.fetch_batch`` and the services' fetch timeout.
FETCH_BATCH = 64
FETCH_TIMEOUT = 1.0
#: Seconds of the requests' and events' duplicate windows (``streams/*.json``).
DUPLICATE_WINDOW = 600.0
MSG_ID = "Nats-Msg-Id"
#: The header the event log's terminal publish carries: one terminal event a subject.
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"

#: Fixed bytes for the events (the floor has no schema): about the size of the
#: pipeline's ``submitted``/``started``; ``completed`` carries the answer's text.
SUBMITTED = b'{"kind":"submitted","routed":{"backend":"mock","attempt":1}}' + b" " * 300
STARTED = b'{"kind":"started","backend":"mock","attempt":1,"run":1}' + b" " * 150


def claim_subject(request_id: str) -> str:
    """The key of a request's terminal claim, as ``$KV.rq-terminal.<tenant>.<id>``."""
    return f"$KV.{CLAIMS_BUCKET}.{TENANT}.{request_id}"


def worker_consumer(variant: str) -> str:
    return f"floor-worker-{variant}"


def request_subject(variant: str) -> str:
    return f"fl.req.normal.{TENANT}.{variant}"


async def streamed_text(adapter: Backend, request: InferenceRequest) -> str:
    """The text of ``adapter``'s streamed answer to ``request``, its stream closed
    (as the worker reads a call): the floor's call and the pipeline's direct one."""
    text = ""
    stream = adapter.stream(request)
    try:
        async for delta in stream:
            text += delta.text
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return text


def the_request(stream: bool | None = False) -> InferenceRequest:
    """The one request the floor's client sends (its bytes) and its adapter calls with
    (``stream``: its field; ``bench/pipeline.py``'s closed loop sends it with ``None``)."""
    raw = {
        "id": uuid.uuid4().hex,
        "tenant": TENANT,
        "route": "chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "priority": "normal",
        "submitted_at": time.time(),
        "stream": stream,
    }
    return REQUEST_DECODER.decode(msgspec.json.encode(raw))


REQUEST_BYTES = msgspec.json.encode(the_request())


async def provision(nc: Connection, slots: int) -> None:
    """The floor's streams (as Ren-Queue's: file, R1; requests and dispatch work queues,
    events limits; the ``claim`` variant's bucket as ``rq-terminal``) and its pull
    consumers (explicit acks; the workers' capped at ``slots`` pending, as a backend's
    concurrency caps Ren-Queue's)."""
    js = nc.client.jetstream()
    common: dict[str, Any] = {
        "storage": StorageType.FILE,
        "num_replicas": 1,
        "discard": DiscardPolicy.NEW,
        "duplicate_window": DUPLICATE_WINDOW,
    }
    await js.add_stream(
        StreamConfig(
            name=REQUESTS, subjects=["fl.req.>"], retention=RetentionPolicy.WORK_QUEUE, **common
        )
    )
    await js.add_stream(
        StreamConfig(
            name=DISPATCH,
            subjects=["fl.dispatch.*"],
            retention=RetentionPolicy.WORK_QUEUE,
            **common,
        )
    )
    await js.add_stream(
        StreamConfig(
            name=EVENTS,
            subjects=["fl.evt.>"],
            retention=RetentionPolicy.LIMITS,
            allow_direct=True,
            **common,
        )
    )
    await js.add_stream(
        StreamConfig(
            name=CLAIMS,
            subjects=[f"$KV.{CLAIMS_BUCKET}.>"],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,
            allow_direct=True,
            allow_rollup_hdrs=True,
            deny_delete=True,
            **{**common, "duplicate_window": 120.0},
        )
    )
    ours = nc.jetstream()
    await ours.add_consumer(
        REQUESTS,
        durable_name=ROUTER_CONSUMER,
        filter_subject=f"fl.req.normal.{TENANT}.*",
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_ack_pending=10_000,
        max_waiting=512,
    )
    for variant in ALL_VARIANTS:
        await ours.add_consumer(
            DISPATCH,
            durable_name=worker_consumer(variant),
            filter_subject=f"fl.dispatch.{variant}",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            max_ack_pending=slots,
            max_waiting=512,
        )


async def stored(nc: Connection) -> dict[str, int]:
    """Messages ever stored per floor stream (last sequence; work queues delete on ack;
    the claims' bucket stores one a request of the ``claim`` variant only)."""
    js = nc.jetstream()
    return {name: int((await js.stream_info(name)).state.last_seq) for name in STREAMS}


class _Tasks:
    """A service's tasks, one a message: kept, counted, their errors kept for the report."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.running: set[asyncio.Task[None]] = set()
        self.freed = asyncio.Event()
        self.errors = 0
        self.samples: list[str] = []

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.freed.set()
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.errors += 1
            if len(self.samples) < 3:
                self.samples.append(f"{self.name}: {type(exc).__name__}: {exc}"[:200])
            print(f"floor {self.name}: {type(exc).__name__}: {exc}", file=sys.stderr)

    async def close(self) -> None:
        for task in self.running:
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)


async def router(nc: Connection, tasks: _Tasks) -> Coroutine[Any, Any, None]:
    """The router (module docstring): its consumer bound, the loop to run (until cancelled)."""
    js = nc.jetstream()
    psub = await js.pull_subscribe_bind(durable=ROUTER_CONSUMER, stream=REQUESTS)

    async def bind(msg: Message) -> None:
        request_id = (msg.headers or {})[MSG_ID]
        variant = msg.subject.rsplit(".", 1)[1]
        event = await js.publish_async(
            f"fl.evt.{TENANT}.{request_id}.submitted",
            SUBMITTED,
            headers={MSG_ID: f"{request_id}:submitted"},
        )
        dispatch = await js.publish_async(
            f"fl.dispatch.{variant}", msg.data, headers={MSG_ID: f"{request_id}:dispatch:1"}
        )
        await asyncio.gather(event, dispatch)
        await msg.ack()

    async def loop() -> None:
        while True:
            try:
                msgs = await psub.fetch(batch=FETCH_BATCH, timeout=FETCH_TIMEOUT)
            except TimeoutError:
                continue
            claimed = [msg for msg in msgs if msg.subject.endswith(f".{CLAIM}")]
            if claimed:
                # As Ren-Queue's intake: the batch's terminal claims looked up together.
                await asyncio.gather(
                    *(claim_of(js, (msg.headers or {})[MSG_ID]) for msg in claimed)
                )
            for msg in msgs:
                tasks.spawn(bind(msg))

    return loop()


async def claim_of(js: JetStream, request_id: str) -> bytes | None:
    """The request's terminal claim, if any: one direct get (``EventLog.stored_claim``)."""
    try:
        raw = await js.get_msg(CLAIMS, subject=claim_subject(request_id), direct=True)
    except NatsNotFoundError:
        return None
    return raw.data


def http_call(
    variant: str, mock_url: str
) -> contextlib.AbstractAsyncContextManager[Callable[[], Awaitable[bytes]]]:
    """The worker's call to the mock in ``variant``: a coroutine function returning the
    answer's text (bytes), in a context that owns the client's pool."""
    return _aiohttp_call(mock_url) if variant == "aiohttp" else _adapter_call(mock_url)


@contextlib.asynccontextmanager
async def _adapter_call(mock_url: str) -> AsyncIterator[Callable[[], Awaitable[bytes]]]:
    config = parse_config(
        {
            "backends": {
                BACKEND: {"base_url": mock_url, "model": "mock", "limits": {"concurrency": 256}}
            },
            "routes": {"chat": {"backends": [BACKEND]}},
        },
        source="<bench floor>",
    )
    adapter: Backend = make_backend(BACKEND, config.backends[BACKEND])
    request = the_request()

    async def call() -> bytes:
        return (await streamed_text(adapter, request)).encode()

    try:
        yield call
    finally:
        await adapter.close()


@contextlib.asynccontextmanager
async def _aiohttp_call(mock_url: str) -> AsyncIterator[Callable[[], Awaitable[bytes]]]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = mock_url.rstrip("/") + "/chat/completions"
    body = msgspec.json.encode(
        {
            "model": "mock",
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}

    async def call() -> bytes:
        lines = []
        async with session.post(url, data=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data:"):
                    lines.append(line)
        if len(lines) < OUTPUT_TOKENS:
            raise RuntimeError(f"expected at least {OUTPUT_TOKENS} events, got {len(lines)}")
        return lines[-2][:200]

    try:
        yield call
    finally:
        await session.close()


async def worker(
    nc: Connection, variant: str, call: Callable[[], Awaitable[bytes]], slots: int, tasks: _Tasks
) -> Coroutine[Any, Any, None]:
    """The worker of ``variant`` (module docstring): its consumer bound, the loop to run."""
    js = nc.jetstream()
    psub = await js.pull_subscribe_bind(durable=worker_consumer(variant), stream=DISPATCH)

    claims = variant == CLAIM

    async def run(msg: Message) -> None:
        request_id = (msg.headers or {})[MSG_ID].split(":", 1)[0]
        prefix = f"fl.evt.{TENANT}.{request_id}"
        if claims and await claim_of(js, request_id) is not None:  # as the worker's gate
            await msg.ack()
            return
        started = await js.publish_async(
            f"{prefix}.started", STARTED, headers={MSG_ID: f"{request_id}:started:1:1"}
        )
        text = await call()
        await started
        completed = b'{"kind":"completed","text":"' + text + b'"}'
        if claims:
            # As EventLog.finish: the claim (holding the event) created, then the event.
            await js.publish(
                claim_subject(request_id), completed, headers={EXPECTED_LAST_SUBJECT_SEQ: "0"}
            )
        await js.publish(f"{prefix}.completed", completed, headers={EXPECTED_LAST_SUBJECT_SEQ: "0"})
        await msg.ack()

    async def loop() -> None:
        while True:
            free = slots - len(tasks.running)
            if free <= 0:
                tasks.freed.clear()
                await tasks.freed.wait()
                continue
            try:
                msgs = await psub.fetch(batch=free, timeout=FETCH_TIMEOUT)
            except TimeoutError:
                continue
            for msg in msgs:
                tasks.spawn(run(msg))

    return loop()


class FloorClient:
    """The floor's client: :meth:`call` submits one request and waits for its end."""

    def __init__(self, nc: Connection) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._waiters: dict[str, asyncio.Future[bytes]] = {}
        self._name = f"floor-tap-{uuid.uuid4().hex[:12]}"
        self._sub: Any = None

    async def start(self) -> None:
        inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(inbox, cb=self._on_message)
        await self._js.add_consumer(
            EVENTS,
            name=self._name,
            filter_subject=f"fl.evt.{TENANT}.*.completed",
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.NEW,
            ack_policy=AckPolicy.NONE,
            idle_heartbeat=5.0,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._js.delete_consumer(EVENTS, self._name)
        for future in self._waiters.values():
            future.cancel()

    async def _on_message(self, msg: Message) -> None:
        parts = msg.subject.split(".")
        if len(parts) == 5:  # not a heartbeat: fl.evt.<tenant>.<id>.completed
            future = self._waiters.pop(parts[3], None)
            if future is not None and not future.done():
                future.set_result(msg.data)

    async def call(self, variant: str, timeout: float = 60.0) -> float:  # noqa: ASYNC109
        """One request through the floor in ``variant``: its latency in seconds."""
        request_id = uuid.uuid4().hex
        future = self._waiters[request_id] = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        try:
            await self._js.publish(
                request_subject(variant), REQUEST_BYTES, headers={MSG_ID: request_id}
            )
            async with asyncio.timeout(timeout):
                await future
        finally:
            self._waiters.pop(request_id, None)
        return time.perf_counter() - start


@contextlib.asynccontextmanager
async def in_process(
    nc: Connection, mock_url: str, slots: int, variants: tuple[str, ...] = VARIANTS
) -> AsyncIterator[dict[str, _Tasks]]:
    """The floor's router and both workers as tasks of this process, on ``nc`` (the
    floor's streams provisioned first); yields their task sets (errors counted there)."""
    await provision(nc, slots)
    services = {"router": _Tasks("router"), **{v: _Tasks(f"worker-{v}") for v in variants}}
    async with contextlib.AsyncExitStack() as stack:
        loops = [asyncio.create_task(await router(nc, services["router"]))]
        for variant in variants:
            call = await stack.enter_async_context(http_call(variant, mock_url))
            loops.append(
                asyncio.create_task(await worker(nc, variant, call, slots, services[variant]))
            )
        try:
            yield services
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for tasks in services.values():
                await tasks.close()
            for loop in loops:
                if not loop.cancelled() and loop.exception() is not None:
                    raise RuntimeError(f"a floor loop died: {loop.exception()!r}")


# ----------------------------------------------------------- as a process (--procs)


async def _serve(args: argparse.Namespace) -> None:
    nc = await connect(args.url, name=f"floor-{args.role}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    tasks = _Tasks(args.role)
    async with contextlib.AsyncExitStack() as stack:
        if args.role == "router":
            main = asyncio.create_task(await router(nc, tasks))
        else:
            call = await stack.enter_async_context(http_call(args.variant, args.mock_url))
            main = asyncio.create_task(await worker(nc, args.variant, call, args.slots, tasks))
        print("ready", flush=True)  # its consumer is bound
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({main, stopped}, return_when=asyncio.FIRST_COMPLETED)
        main.cancel()
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await main
        await tasks.close()
    await nc.close()
    if tasks.errors:
        print(f"floor {args.role}: {tasks.errors} errors", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description="a process of the floor (bench/pipeline.py)")
    parser.add_argument("role", choices=("router", "worker"))
    parser.add_argument("--url", required=True, help="the nats-server")
    parser.add_argument("--variant", choices=ALL_VARIANTS, default="adapter")
    parser.add_argument("--mock-url", default="")
    parser.add_argument("--slots", type=int, default=256)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
