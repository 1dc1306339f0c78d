"""How fast the router rejects: a backlog of malformed requests, then one router alone.

First the services start without a router and ``--count`` malformed requests are
published on ``rq.req.<level>.<tenant>`` (``--kind``: ``noheader``, a valid body
without its ``Nats-Msg-Id``, rejected under the body's id; ``junk``, bytes that are
not JSON, rejected as ``invalid-<seq>``), spread over ``--tenants`` tenants. Then
the services start again on the same store with one router (no worker) and the
script waits until every message has its dead letter in ``RQ_DLQ``. The rate is
the dead letters' count over the server's timestamps of the first and the last one,
so neither the start-up nor this script's own polling is in it. ``--profile FILE``
writes a cProfile of the router phase (this process: router, projector, poller).

    .venv/bin/python bench/rejections.py --count 2000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import tempfile
import time
from pathlib import Path

import msgspec
from prometheus_client import REGISTRY

from renqueue import Client, Services, parse_config
from renqueue.config import Config
from renqueue.errors import NatsNotFoundError

try:  # not in trees before router.tenant_backlog (the script measures those too)
    from renqueue.errors import TenantBacklogFullError
except ImportError:  # pragma: no cover
    TenantBacklogFullError = NatsNotFoundError  # type: ignore[misc,assignment]
from renqueue.schema import DLQ_STREAM, EVENTS_STREAM, event_subject, request_subject


def make_config(data_dir: Path, tenant_backlog: int = 0) -> Config:
    raw: dict[str, object] = {
        "nats": {"data_dir": str(data_dir), "port": -1},
        "backends": {"b": {"base_url": "http://127.0.0.1:9", "model": "mock"}},
        "routes": {"chat": {"backends": ["b"]}},
    }
    if tenant_backlog:
        raw["router"] = {"tenant_backlog": tenant_backlog}
    return parse_config(raw)


async def flood(
    config: Config, count: int, kind: str, tenants: int, level: str, *, good: bool
) -> int:
    """Publish the backlog (and, ``good``, then one valid request of tenant
    ``calm``); the number of malformed requests stored (the rest refused)."""
    async with Services(config, routers=0, backends=[], projector=False) as services:
        assert services.nc is not None
        assert services.js is not None
        names = [f"t{i}" for i in range(tenants)]
        clients = {name: Client(services.nc, tenant=name) for name in names}
        futures = []
        refused = 0
        for i in range(count):
            tenant = names[i % tenants]
            subject = request_subject(level, tenant)
            if kind == "junk":
                data = b"{not json " + str(i).encode()
            else:
                request = clients[tenant].build_request(
                    "hi", route="chat", priority=level, request_id=f"flood-{i}"
                )
                data = msgspec.json.encode(request)
            if getattr(config.router, "tenant_backlog", 0):
                # One at a time: a refused publish_async may never resolve (seen here).
                try:
                    await services.js.publish(subject, data)
                except TenantBacklogFullError:
                    refused += 1
            else:
                futures.append(await services.js.publish_async(subject, data))
        acks = await asyncio.gather(*futures, return_exceptions=True)
        if good:
            calm = Client(services.nc, tenant="calm")
            await calm.submit("hi", route="chat", priority=level, request_id="calm-0")
        return count - refused - sum(1 for ack in acks if isinstance(ack, BaseException))


async def drain(config: Config, count: int, *, good: bool) -> dict[str, float]:
    started = time.monotonic()
    async with Services(config, routers=1, backends=[]) as services:
        assert services.js is not None
        while True:
            info = await services.js.stream_info(DLQ_STREAM)
            if info.state.messages >= count:
                break
            if time.monotonic() - started > 900:
                raise SystemExit(f"only {info.state.messages} of {count} dead letters in 900 s")
            await asyncio.sleep(0.1)
        wall = time.monotonic() - started
        first = await services.js.get_msg(DLQ_STREAM, seq=info.state.first_seq)
        last = await services.js.get_msg(DLQ_STREAM, seq=info.state.last_seq)
        calm_at = float("nan")
        if good:
            subject = event_subject("calm", "calm-0", "submitted")
            while time.monotonic() - started < 900:
                try:
                    calm_at = _stamp(await services.js.get_last_msg(EVENTS_STREAM, subject))
                    break
                except NatsNotFoundError:
                    await asyncio.sleep(0.1)
    span = _stamp(last) - _stamp(first)
    return {
        "calm_after_first_s": calm_at - _stamp(first),
        "dead_letters": float(info.state.messages),
        "span_s": span,
        "rate_per_s": (count - 1) / span if span > 0 else float("inf"),
        "wall_s": wall,
    }


def _stamp(msg: object) -> float:
    """When the server stored ``msg`` (a get's ``time``), Unix seconds."""
    stamp = msg.time  # type: ignore[attr-defined]
    return float(stamp.timestamp()) if stamp is not None else float("nan")


def _rejected() -> float:
    """``renqueue_rejected_total`` of this process, over every error type."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "renqueue_rejected"
        for sample in metric.samples
        if sample.name == "renqueue_rejected_total"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--kind", choices=["noheader", "junk"], default="noheader")
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--level", default="normal")
    parser.add_argument("--profile", type=Path)
    parser.add_argument(
        "--good",
        action="store_true",
        help="after the backlog, one valid request of another tenant (calm) at the level",
    )
    parser.add_argument("--tenant-backlog", type=int, default=0, help="router.tenant_backlog")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rq-rejections-") as tmp:
        config = make_config(Path(tmp) / "nats", args.tenant_backlog)
        stored = await flood(
            config, args.count, args.kind, args.tenants, args.level, good=args.good
        )
        load = os.getloadavg()[0]
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        result = await drain(config, stored, good=args.good)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
    print(
        f"rejections ({args.kind}, {stored} over {args.tenants} tenant(s)): "
        f"{result['rate_per_s']:.1f}/s over {result['span_s']:.2f} s "
        f"(wall {result['wall_s']:.1f} s); 1-minute load {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {result['dead_letters']:.0f} dead letters, "
        f"renqueue_rejected_total {_rejected():.0f}"
    )
    if stored < args.count:
        print(
            f"  refused at the publish (router.tenant_backlog {args.tenant_backlog}): "
            f"{args.count - stored}"
        )
    if args.good:
        print(
            "  calm's request logged `submitted` "
            f"{result['calm_after_first_s']:.2f} s after the first dead letter"
        )


if __name__ == "__main__":
    asyncio.run(main())
