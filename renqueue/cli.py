"""The ``renqueue`` command line.

::

    renqueue up                 embedded NATS (unless --nats) + provision + routers + workers
    renqueue router             router processes only (scale out)
    renqueue worker -b NAME     workers for some backends only (scale out)
    renqueue provision          apply streams/ to NATS, idempotently
    renqueue submit PROMPT      submit one request; --stream prints tokens as they come
    renqueue cancel ID          cancel a request: queued never runs, running is stopped
    renqueue audit ID           one request's timeline from the event log
    renqueue schema             JSON Schema of every wire message and event
    renqueue mock-backend       an OpenAI-compatible mock LLM server
    renqueue demo               everything embedded, a mixed workload, a summary

Exit codes: 0 done (``submit``: the request completed; ``cancel``: it was
cancelled, or the cancellation was recorded when not waiting); 2 a Ren-Queue
error (bad config, NATS unreachable, no such request, ...); 3 the request
ended, but not as asked (``submit``: failed, expired, cancelled or rejected;
``cancel``: it had already ended otherwise); 4 ``--wait`` ran out before the
request ended (it goes on: follow it with ``renqueue audit``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from .config import Config, load_config
from .errors import ConfigError, RenQueueError, RequestFailedError
from .logs import configure_logging, get_logger

__all__ = ["main"]

#: Exit codes (see the module docstring).
EXIT_OK, EXIT_ERROR, EXIT_UNSUCCESSFUL, EXIT_WAIT_TIMEOUT = 0, 2, 3, 4


class _WaitTimeout(RenQueueError):
    """``--wait`` ran out before the request ended."""


def _with_nats(config: Config, url: str | None) -> Config:
    if url:
        return msgspec.structs.replace(config, nats=msgspec.structs.replace(config.nats, url=url))
    return config


def _client_url(config: Config) -> str:
    from .ops._connection import resolve_nats_url

    url = resolve_nats_url(config)
    if url is None:
        raise ConfigError(
            "no NATS URL: give --nats or RENQUEUE_NATS_URL, or start `renqueue up` first",
            path="$.nats.url",
        )
    return url


async def _up(config: Config, args: argparse.Namespace) -> None:
    from .services._service import Services, run_until_signalled

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr="127.0.0.1")
    backends = None if args.backend is None else args.backend
    routers = args.routers
    if args.command == "router":
        backends = []
    elif args.command == "worker":
        routers = 0
    if args.command != "up" and not config.nats.url:
        # Scaling out joins a running Ren-Queue; it never starts a second
        # embedded server on the same store.
        config = _with_nats(config, _client_url(config))
    await run_until_signalled(Services(config, routers=routers, backends=backends))


async def _provision(config: Config, _args: argparse.Namespace) -> None:
    from .ops._connection import connect
    from .ops._provision import provision

    nc = await connect(_client_url(config), name="renqueue-provision", config=config.nats)
    try:
        report = await provision(nc, config)
        print(report)
    finally:
        await nc.drain()


async def _submit(config: Config, args: argparse.Namespace) -> None:
    from ._client import Client

    client = await Client.connect(_client_url(config), tenant=args.tenant, name="renqueue-cli")
    async with client:
        handle = await client.submit(
            args.prompt,
            route=args.route,
            priority=args.priority or config.default_priority,
            request_id=args.id,
            max_tokens=args.max_tokens,
            timeout=args.timeout,
        )
        print(f"request {handle.id}{' (already submitted)' if handle.duplicate else ''}")
        if args.stream:
            async for chunk in handle.stream():
                if chunk.restart:
                    print("\n[restarted]", flush=True)
                print(chunk.text, end="", flush=True)
            print()
        result = await _wait(handle, args.wait)
        if args.json:
            print(json.dumps(msgspec.to_builtins(result)))
        else:
            if not args.stream:
                print(result.text)
            print(
                f"-- backend={result.backend} tokens={result.usage.prompt_tokens}+"
                f"{result.usage.completion_tokens} cost=${result.cost:.6f} "
                f"duration={result.duration:.3f}s"
            )


async def _cancel(config: Config, args: argparse.Namespace) -> None:
    from ._client import Client
    from .errors import RequestCancelledError

    client = await Client.connect(_client_url(config), tenant=args.tenant, name="renqueue-cli")
    async with client:
        handle = client.handle(args.request_id)
        known = await handle.events()
        await handle.cancel(args.reason)
        if not known:
            raise RenQueueError(
                f"no request {handle.id} is known for tenant {args.tenant!r} (no events): it was "
                "never submitted, or no router has read it yet; the cancellation is recorded "
                "and applies if it arrives"
            )
        print(f"cancellation requested for {handle.id}")
        if args.wait is None:
            return
        try:
            result = await _wait(handle, args.wait)
        except RequestCancelledError:
            print(f"request {handle.id} cancelled")
            return
        raise RequestFailedError(
            f"already ended: completed on {result.backend} before the cancellation",
            request_id=handle.id,
            error_type="completed",
        )


async def _wait(handle: Any, wait: float | None) -> Any:
    """The handle's result; ``_WaitTimeout`` if ``wait`` seconds pass first."""
    try:
        return await handle.result(timeout=wait)
    except TimeoutError as exc:
        raise _WaitTimeout(
            f"request {handle.id} has not ended after {wait:g} s; it goes on "
            f"(follow it with `renqueue audit {handle.id}`)"
        ) from exc


async def _audit(config: Config, args: argparse.Namespace) -> None:
    from .ops._connection import connect
    from .wire._eventlog import EventLog

    nc = await connect(_client_url(config), name="renqueue-audit", config=config.nats)
    try:
        events = await EventLog(nc.jetstream()).history(args.tenant or "*", args.request_id)
    finally:
        await nc.drain()
    if not events:
        raise RenQueueError(f"no events for request {args.request_id}")
    for event in events:
        data = msgspec.to_builtins(event)
        if args.json:
            print(json.dumps(data))
            continue
        when = datetime.datetime.fromtimestamp(event.at, tz=datetime.UTC).isoformat(
            timespec="milliseconds"
        )
        kind = data.pop("kind")
        for key in ("v", "request_id", "tenant", "at"):
            data.pop(key, None)
        if kind == "submitted":
            request = data.pop("request")
            data = {
                "route": request["route"],
                "priority": request["priority"],
                "messages": len(request["messages"]),
            }
        if kind == "completed":
            data["text"] = _shorten(data["text"])
        details = " ".join(f"{k}={v}" for k, v in data.items() if v not in (None, ""))
        print(f"{when}  {kind:<10} {details}")


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _schema(_config: Config, _args: argparse.Namespace) -> None:
    from .wire import Dispatch, Event, InferenceRequest, TokenChunk

    types: list[Any] = [InferenceRequest, Dispatch, TokenChunk, Event]
    (_schemas, components) = msgspec.json.schema_components(types)
    print(json.dumps({"$defs": components}, indent=2, sort_keys=True))


def _mock_backend(_config: Config, args: argparse.Namespace) -> None:
    from .tools._mockbackend import run_mock_backend

    try:
        run_mock_backend(
            host=args.host,
            port=args.port,
            ttft=args.ttft,
            tps=args.tps,
            output_tokens=args.output_tokens,
            failure_rate=args.failure_rate,
            rpm=args.rpm,
            tpm=args.tpm,
            rpd=args.rpd,
            limit_style=args.limit_style,
            concurrency=args.concurrency,
            model=args.model,
            seed=args.seed,
            on_ready=lambda url: print(f"mock backend serving at {url}", flush=True),
        )
    except ValueError as exc:
        raise ConfigError(str(exc), path="mock-backend options") from exc


async def _demo(config: Config, args: argparse.Namespace) -> None:
    from .tools._demo import run_demo

    ok = await run_demo(requests=args.requests)
    if not ok:
        raise SystemExit(1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="renqueue",
        description=__doc__.splitlines()[0],
        epilog=__doc__[__doc__.index("Exit codes") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-c", "--config", help="TOML config file (default: ./renqueue.toml)")
    parser.add_argument("--nats", help="NATS URL (default: embedded server / RENQUEUE_NATS_URL)")
    parser.add_argument(
        "--log-level", help="DEBUG, INFO, WARNING, ERROR (default: INFO; the demo: ERROR)"
    )
    parser.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, text in (
        ("up", "run embedded NATS (unless --nats), routers and workers"),
        ("router", "run router processes only"),
        ("worker", "run workers only"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--routers", type=int, default=1, help="router loops in this process")
        cmd.add_argument(
            "-b", "--backend", action="append", help="serve only this backend (repeatable)"
        )
        cmd.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
        cmd.set_defaults(run=_up)

    sub.add_parser("provision", help="apply streams/ to NATS").set_defaults(run=_provision)

    cmd = sub.add_parser("submit", help="submit one request")
    cmd.add_argument("prompt")
    cmd.add_argument("--route", required=True)
    cmd.add_argument("--priority", help="level name (default: config default_priority)")
    cmd.add_argument("--tenant", default="default")
    cmd.add_argument("--id", help="request id (idempotency key)")
    cmd.add_argument("--max-tokens", type=int)
    cmd.add_argument("--timeout", type=float, help="deadline, seconds from now")
    cmd.add_argument("--wait", type=float, help="give up waiting for the result after N s")
    cmd.add_argument("--stream", action="store_true", help="print tokens as they come")
    cmd.add_argument("--json", action="store_true", help="print the result as JSON")
    cmd.set_defaults(run=_submit)

    cmd = sub.add_parser("cancel", help="cancel a request (queued: never runs; running: stopped)")
    cmd.add_argument("request_id")
    cmd.add_argument("--tenant", default="default")
    cmd.add_argument("--reason", default="")
    cmd.add_argument("--wait", type=float, help="wait up to N s for the request to end")
    cmd.set_defaults(run=_cancel)

    cmd = sub.add_parser("audit", help="one request's timeline")
    cmd.add_argument("request_id")
    cmd.add_argument("--tenant", help="tenant (default: any)")
    cmd.add_argument("--json", action="store_true", help="one JSON event per line")
    cmd.set_defaults(run=_audit)

    sub.add_parser("schema", help="JSON Schema of messages and events").set_defaults(run=_schema)

    _add_tool_commands(sub)
    return parser


def _add_tool_commands(sub: Any) -> None:
    """The mock backend and the demo: tools around Ren-Queue, not part of it."""
    cmd = sub.add_parser("mock-backend", help="OpenAI-compatible mock LLM server")
    cmd.add_argument("--host", default="127.0.0.1")
    cmd.add_argument("--port", type=int, default=8100)
    cmd.add_argument("--ttft", type=float, default=0.05, help="seconds to first token")
    cmd.add_argument("--tps", type=float, default=100.0, help="tokens per second (0: instant)")
    cmd.add_argument("--output-tokens", type=int, default=32)
    cmd.add_argument("--failure-rate", type=float, default=0.0)
    cmd.add_argument("--rpm", type=int, default=0, help="requests per minute it allows (0: any)")
    cmd.add_argument("--tpm", type=int, default=0, help="tokens per minute it allows (0: any)")
    cmd.add_argument("--rpd", type=int, default=0, help="requests per day it allows (0: any)")
    cmd.add_argument(
        "--limit-style",
        default="openai",
        help="rate-limit header dialect: openai, groq, cerebras, openrouter, "
        "openrouter-body, anthropic, gemini, ietf",
    )
    cmd.add_argument("--concurrency", type=int, default=0, help="concurrent requests (0: any)")
    cmd.add_argument("--model", help="accept only this model name (default: any)")
    cmd.add_argument("--seed", type=int, help="seed for reproducible failure draws")
    cmd.set_defaults(run=_mock_backend)

    cmd = sub.add_parser("demo", help="run everything embedded on a mixed workload")
    cmd.add_argument("--requests", type=int, default=200)
    cmd.set_defaults(run=_demo)


_SERVICE_COMMANDS = frozenset({"up", "router", "worker"})


def _has_config_file(path: str | None) -> bool:
    """Whether ``load_config`` read a file (it falls back to the defaults silently)."""
    return bool(path or os.environ.get("RENQUEUE_CONFIG")) or os.path.exists("renqueue.toml")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet = args.command == "demo"  # the demo's terminal display is its output
    configure_logging(level=args.log_level or ("ERROR" if quiet else "INFO"), json=args.log_json)
    try:
        config = _with_nats(load_config(args.config), args.nats)
        if args.command in _SERVICE_COMMANDS and not _has_config_file(args.config):
            get_logger(__name__).warning(
                "no config file (./renqueue.toml not found, no -c or $RENQUEUE_CONFIG): "
                "running with the defaults, which have no backends and no routes"
            )
        result = args.run(config, args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    except RequestFailedError as exc:
        print(f"renqueue: {exc} [{exc.error_type}]", file=sys.stderr)
        return EXIT_UNSUCCESSFUL
    except _WaitTimeout as exc:
        print(f"renqueue: {exc}", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    except RenQueueError as exc:
        print(f"renqueue: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
