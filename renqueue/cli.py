"""The ``renqueue`` command line.

::

    renqueue up                 embedded NATS (unless --nats) + provision + routers + workers
                                (+ the gateway, when [gateway] has API keys)
    renqueue gateway            the OpenAI-compatible HTTP gateway only (scale out);
                                `gateway keygen TENANT` makes an API key
    renqueue exporter --port P  the cluster-wide Prometheus metrics, one scrape target
    renqueue router             router processes only (scale out)
    renqueue worker -b NAME     workers for some backends only (scale out)
    renqueue provision          apply streams/ to NATS, idempotently
    renqueue submit PROMPT      submit one request; --stream prints tokens as they come
    renqueue cancel ID          cancel a request: queued never runs, running is stopped
    renqueue audit ID           one request's timeline from the event log
    renqueue status             each backend, priority level and tenant now (--watch)
    renqueue replay             the projection rebuilt from the log (--verify: against
                                the live one, field by field; --what-if FILE: the
                                recorded requests simulated under this config and FILE)
    renqueue dlq list|show|requeue|purge
                                the dead-letter stream: what failed for good, with why
                                and the request's history; requeue it as a new request
    renqueue ab status|promote|rollback|resume
                                A/B splits: each arm's figures; move all of a split's
                                traffic to one arm, back to its control, or split again
    renqueue schema             JSON Schema of every wire message and event
    renqueue mock-backend       a mock LLM server (OpenAI, Anthropic, Ollama, TGI, Gemini APIs)
    renqueue demo               everything embedded, a mixed workload, a summary

Exit codes: 0 done (``submit``: the request completed; ``cancel``: it was
cancelled, or the cancellation was recorded when not waiting); 2 a Ren-Queue
error (bad config, NATS unreachable, no such request, ...); 3 the request
ended, but not as asked (``submit``: failed, expired, cancelled or rejected;
``cancel``: it had already ended otherwise); 4 ``--wait`` ran out before the
request ended (it goes on: follow it with ``renqueue audit``). ``replay
--verify``: 0 the live projection equals the log's, 1 it differs, 2 it cannot
be checked (nothing stored, NATS unreachable, the log no longer holds every
event the projection folded, a replay that stopped short). ``replay
--what-if``: 0 the comparison was printed, 2 it cannot be made (a bad what-if
file, NATS unreachable, no request submitted in the window). ``dlq``: 0 done
(``purge`` declined at its prompt: nothing deleted, 0 too), 1 some entries
failed (no such entry, a poison message cannot be requeued, ...: one line each
on stderr, the others done), 2 cannot read (NATS unreachable, no dead-letter
stream, bad arguments). ``ab``: 0 done (a split already where it was asked to
go, too), 2 an error (no such split or arm, NATS unreachable). ``status``,
``replay``, ``dlq`` and ``ab`` end any error they did not expect with 2 and one
line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from .config import Config, load_config
from .errors import ConfigError, NatsClosedError, RenQueueError, RequestFailedError
from .logs import configure_logging, get_logger
from .text import shorten

if TYPE_CHECKING:
    from .broker import Connection
    from .coordination import Replayed, StatusReport, Verification

__all__ = ["main"]

_T = TypeVar("_T")

#: Exit codes (see the module docstring).
EXIT_OK, EXIT_ERROR, EXIT_UNSUCCESSFUL, EXIT_WAIT_TIMEOUT = 0, 2, 3, 4
#: ``replay --verify``: the live projection differs from the log's.
EXIT_DIFFERENT = 1
#: ``dlq``: some of the entries asked for could not be shown, requeued or purged.
EXIT_SOME_FAILED = 1
#: The shortest ``status --interval`` (seconds): each redraw reads every consumer.
MIN_INTERVAL = 0.2


class _WaitTimeout(RenQueueError):
    """``--wait`` ran out before the request ended."""


class _UnexpectedError(RenQueueError):
    """An error ``status`` or ``replay`` did not expect, as one line (exit 2)."""


def _guarded(
    run: Callable[[Config, argparse.Namespace], Awaitable[_T]],
) -> Callable[[Config, argparse.Namespace], Awaitable[_T]]:
    """``run`` with any error that is not a Ren-Queue one turned into one line.

    ``status`` and ``replay`` read what others wrote (a damaged or forged
    checkpoint, a log cut short): whatever they meet, they end with exit 2 and
    a line on stderr, never a traceback.
    """

    @functools.wraps(run)
    async def guarded(config: Config, args: argparse.Namespace) -> _T:
        try:
            return await run(config, args)
        except RenQueueError:
            raise
        except Exception as exc:
            from .text import printable

            raise _UnexpectedError(
                f"{args.command}: unexpected error: {printable(_one_line(exc))}"
            ) from exc

    return guarded


def _with_nats(config: Config, url: str | None) -> Config:
    if url:
        return msgspec.structs.replace(config, nats=msgspec.structs.replace(config.nats, url=url))
    return config


def _client_url(config: Config) -> str:
    from .broker import resolve_nats_url

    url = resolve_nats_url(config)
    if url is None:
        raise ConfigError(
            "no NATS URL: give --nats or RENQUEUE_NATS_URL, or start `renqueue up` first",
            path="$.nats.url",
        )
    return url


async def _up(config: Config, args: argparse.Namespace) -> None:
    from .services import Services, run_until_signalled

    backends = None if args.backend is None else args.backend
    routers = args.routers
    if args.command == "router":
        backends = []
    elif args.command == "worker":
        routers = 0
    cluster = None
    if args.metrics_port:
        from prometheus_client import REGISTRY, start_http_server

        if routers > 0:  # it runs the projector: the cluster-wide series too (issue 27)
            from .coordination import ClusterMetrics

            cluster = ClusterMetrics(config)
            REGISTRY.register(cluster)
        start_http_server(args.metrics_port, addr="127.0.0.1")
    if args.command != "up" and not config.nats.url:
        # Scaling out joins a running Ren-Queue; it never starts a second
        # embedded server on the same store.
        config = _with_nats(config, _client_url(config))
    services: Services
    if args.command == "up" and _gateway_wanted(config):
        from .process import ServicesWithGateway

        services = ServicesWithGateway(
            config, routers=routers, backends=backends, cluster_metrics=cluster
        )
    else:
        services = Services(config, routers=routers, backends=backends, cluster_metrics=cluster)
    await run_until_signalled(services)


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


async def _gateway(config: Config, args: argparse.Namespace) -> None:
    from .gateway import run_gateway

    if args.port is not None or args.host is not None:
        gateway = msgspec.structs.replace(
            config.gateway,
            port=config.gateway.port if args.port is None else args.port,
            host=config.gateway.host if args.host is None else args.host,
        )
        config = msgspec.structs.replace(config, gateway=gateway)
    await run_gateway(config, _client_url(config))


async def _exporter(config: Config, args: argparse.Namespace) -> None:
    from .coordination import run_exporter

    await run_exporter(config, _client_url(config), host=args.host, port=args.port)


def _keygen(_config: Config, args: argparse.Namespace) -> None:
    from .gateway import digest, new_key

    if args.admin == (args.tenant is not None):
        raise RenQueueError("give a TENANT, or --admin for the console's admin key (not both)")
    key = new_key()
    if args.admin:
        print("Admin key for the console (shown once; it opens /console, for no tenant):")
        print(f"  {key}")
        print("Add its digest to the gateway's config (it stores the digest, never the key):")
        print(f'  [gateway]\n  admin_keys = ["{digest(key)}"]')
        return
    print(f"API key for tenant {args.tenant} (shown once; give it to the client):")
    print(f"  {key}")
    print("Add one of these to the gateway's config (it stores the digest, never the key):")
    print(f'  [[gateway.keys]]\n  tenant = "{args.tenant}"\n  sha256 = "{digest(key)}"')
    print(f"  or a line of [gateway] keys_file:  sha256:{digest(key)} {args.tenant}")


async def _provision(config: Config, _args: argparse.Namespace) -> None:
    from .broker import connect, provision

    nc = await connect(_client_url(config), name="renqueue-provision", config=config.nats)
    try:
        report = await provision(nc, config)
        print(report)
    finally:
        await nc.drain()


async def _submit(config: Config, args: argparse.Namespace) -> None:
    from .client import Client

    client = await Client.connect(_client_url(config), tenant=args.tenant, name="renqueue-cli")
    async with client:
        handle = await client.submit(
            args.prompt,
            route=args.route,
            priority=args.priority or config.default_priority,
            request_id=args.id,
            max_tokens=args.max_tokens,
            timeout=args.timeout,
            max_cost=args.max_cost,
            complexity=args.complexity,
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
    from .client import Client
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
    from .broker import EventLog, connect
    from .schema import parse_traceparent

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
            trace = parse_traceparent(data.get("traceparent"))
            data = {
                "route": request["route"],
                "priority": request["priority"],
                "messages": len(request["messages"]),
                "trace": None if trace is None else trace.trace_id,
            }
        if kind == "completed":
            data["text"] = shorten(data["text"], 60)
        details = " ".join(f"{k}={v}" for k, v in data.items() if v not in (None, ""))
        print(f"{when}  {kind:<10} {details}")


async def _status(config: Config, args: argparse.Namespace) -> None:
    """Print the status once, or (``--watch``) every ``--interval`` seconds until Ctrl-C.

    A watch rides out what NATS fails to answer for a while (the server
    restarting, a timeout): it shows the error in place of that redraw and
    tries again at the next; only a connection closed for good ends it.
    """
    from .broker import connect
    from .coordination import read_status

    nc = await connect(_client_url(config), name="renqueue-status", config=config.nats)
    try:
        js = nc.jetstream()
        clear = args.watch and not args.json and sys.stdout.isatty()
        while True:
            try:
                report = await read_status(js, config)
            except NatsClosedError:
                raise
            except Exception as exc:
                if not args.watch or nc.is_closed:
                    raise
                _show_status_error(exc, args, clear=clear)
            else:
                _show_status(report, args, clear=clear)
            if not args.watch:
                return
            if not clear and not args.json:
                print()
            sys.stdout.flush()
            await asyncio.sleep(args.interval)
    finally:
        await _close(nc)


def _show_status(report: StatusReport, args: argparse.Namespace, *, clear: bool) -> None:
    from .coordination import render_status

    if args.json:
        print(msgspec.json.encode(report).decode())
        return
    if clear:
        print("\x1b[H\x1b[2J", end="")  # cursor home, clear the screen
    print("\n".join(render_status(report)))


def _show_status_error(exc: Exception, args: argparse.Namespace, *, clear: bool) -> None:
    """A watch's redraw that could not read the status: one line (JSON: ``{"at", "error"}``)."""
    from .text import printable

    now = datetime.datetime.now(tz=datetime.UTC)
    message = printable(_one_line(exc))
    if args.json:
        print(json.dumps({"at": now.timestamp(), "error": message}))
        return
    if clear:
        print("\x1b[H\x1b[2J", end="")
    print(
        f"Ren-Queue status at {now.isoformat(timespec='seconds')}: cannot read it: {message}"
        f" (trying again every {args.interval:g} s; Ctrl-C to stop)"
    )


def _one_line(exc: BaseException) -> str:
    """An error as one line: its message, or its type when it has none or is not ours."""
    text = " ".join(str(exc).split())
    if isinstance(exc, RenQueueError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _close(nc: Connection) -> None:
    """Drain ``nc``, or close it if it cannot drain (reconnecting, or too slow)."""
    try:
        await asyncio.wait_for(nc.drain(), 5.0)
    except Exception:  # noqa: BLE001 - whatever the connection's state, it ends closed
        if not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()


async def _replay(config: Config, args: argparse.Namespace) -> int:
    from .broker import connect
    from .coordination import replay_log, verify
    from .state import encode_state

    if args.what_if is not None:
        return await _what_if(config, args)
    if args.since is not None or args.until is not None or args.seed is not None:
        raise RenQueueError("--since, --until and --seed go with --what-if")
    nc = await connect(_client_url(config), name="renqueue-replay", config=config.nats)
    try:
        js = nc.jetstream()
        if not args.verify:
            replayed = await replay_log(js)
            if args.json:
                print(encode_state(replayed.state).decode())
            else:
                print("\n".join(_replay_summary(replayed)))
            return EXIT_OK
        found = await verify(js)
    finally:
        await _close(nc)
    if args.json:
        print(json.dumps({"equal": found.equal, **msgspec.to_builtins(found)}))
    else:
        print("\n".join(_verification_lines(found)))
    return EXIT_OK if found.equal else EXIT_DIFFERENT


async def _what_if(config: Config, args: argparse.Namespace) -> int:
    """``replay --what-if FILE``: the requests submitted in the window, as they
    really went, and simulated under this config and FILE's (docs/what-if.md)."""
    from .broker import connect
    from .coordination import read_trace
    from .sim import compare, load_what_if, render
    from .text import printable

    if args.verify:
        raise RenQueueError("--what-if and --verify do not go together")
    other = load_what_if(args.what_if)
    now = datetime.datetime.now(tz=datetime.UTC).timestamp()
    since = now - 3600.0 if args.since is None else args.since
    until = now if args.until is None else args.until
    if until <= since:
        raise RenQueueError("--until must be after --since")
    nc = await connect(_client_url(config), name="renqueue-replay", config=config.nats)
    try:
        trace = await read_trace(nc.jetstream(), since=since, until=until)
    finally:
        await _close(nc)
    window = f"{_iso(since)} .. {_iso(until)}"
    if not trace.arrivals:
        raise RenQueueError(
            f"no request was submitted between {window} ({trace.events} events read):"
            " nothing to replay; widen --since/--until"
        )
    seed = 0 if args.seed is None else args.seed
    title = printable(os.path.basename(str(args.what_if)))[:40] or "what-if"
    comparison = compare(
        trace,
        [("this config (sim)", config), (f"{title} (sim)", other.config)],
        seed=seed,
        models=other.models,
    )
    if args.json:
        print(msgspec.json.encode(_what_if_json(trace, comparison, seed)).decode())
    else:
        print("\n".join(render(trace, comparison.columns, seed=seed)))
    return EXIT_OK


def _what_if_json(trace: Any, comparison: Any, seed: int) -> dict[str, Any]:
    return {
        "since": trace.since,
        "until": trace.until,
        "seed": seed,
        "events": trace.events,
        "dropped": trace.dropped,
        "columns": [
            {
                "title": column.title,
                "requests": column.summary.requests,
                "cost": column.summary.cost,
                "ended": column.summary.ended,
                "levels": {
                    name: {**msgspec.to_builtins(level), "attainment": level.attainment}
                    for name, level in column.summary.levels.items()
                },
                "share": {name: column.summary.share_of(name) for name in column.summary.share},
                "notes": list(column.notes),
            }
            for column in comparison.columns
        ],
    }


def _iso(at: float) -> str:
    when = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def _verification_lines(found: Verification) -> list[str]:
    from .text import printable

    at = f"{found.events} events, last_seq {found.last_seq}"
    if found.views_compared:
        views = f"views: {found.views} backend views compared"
    elif found.progress_seq is None:
        views = "views not compared: no progress mark (view.progress) stored"
    elif found.progress_seq < found.last_seq:
        views = (
            f"views not compared: progress {found.progress_seq} behind checkpoint {found.last_seq}"
        )
    elif found.progress_seq == found.last_seq:
        views = "views not compared: the projector kept writing while they were read"
    else:
        views = f"views not compared: progress {found.progress_seq}, checkpoint {found.last_seq}"
    if found.equal:
        return [f"equal ({at})", views]
    lines = [
        f"different: {len(found.differences)} field(s) differ from the log replayed ({at})",
        views,
        "",
    ]
    paths = [printable(d.path) for d in found.differences]
    width = min(60, max(len(path) for path in paths))
    lines.append(f"  {'field':<{width}}  {'live':>12}  rebuilt from the log")
    lines.extend(
        f"  {path:<{width}}  {_value(d.live):>12}  {_value(d.rebuilt)}"
        for path, d in zip(paths, found.differences, strict=True)
    )
    return lines


def _value(value: Any) -> str:
    if value is msgspec.UNSET:
        return "(absent)"
    return shorten(json.dumps(value), 80)


def _replay_summary(replayed: Replayed) -> list[str]:
    from .text import clock, printable

    state = replayed.state
    ended = (
        " ".join(f"{printable(kind)}={n}" for kind, n in sorted(state.terminal.items())) or "none"
    )
    when = clock(state.log_time) if state.log_time else "-"
    lines = [
        f"Replayed {state.events} events (last_seq {state.last_seq}, log time {when});"
        f" skipped {state.skipped} undecodable, {state.mismatched} disagreeing with their subject",
        f"  submitted {state.submitted}; ended {ended}; in flight {state.in_flight_count};"
        f" spend ${state.spend:.6f}",
    ]
    gone = []
    if replayed.first_seq > 1:
        gone.append(
            f"it starts at sequence {replayed.first_seq} (those before expired, or were purged)"
        )
    if replayed.deleted:
        gone.append(f"{replayed.deleted} after its start were purged")
    if gone:
        lines.append(f"  not in this replay: {'; '.join(gone)}")
    lines += [
        "",
        f"  {'backend':<16} {'started':>8} {'done':>7} {'failed':>6} {'429s':>5}"
        f" {'tokens in':>10} {'tokens out':>10} {'spend $':>10} {'in flight':>9}",
    ]
    for name, b in sorted(state.backends.items()):
        lines.append(
            f"  {printable(name):<16} {b.calls_started:>8} {b.calls_completed:>7}"
            f" {b.calls_failed:>6} {b.rate_limited:>5} {b.tokens_in:>10} {b.tokens_out:>10}"
            f" {b.spend:>10.6f} {b.in_flight:>9}"
        )
    lines += ["", f"  {'tenant':<16} {'submitted':>9} {'spend $':>10}  ended"]
    for name, t in sorted(state.tenants.items()):
        ended = " ".join(f"{printable(k)}={n}" for k, n in sorted(t.terminal.items())) or "-"
        lines.append(f"  {printable(name):<16} {t.submitted:>9} {t.spend:>10.6f}  {ended}")
    return lines


async def _dlq(config: Config, args: argparse.Namespace) -> int:
    """``renqueue dlq list|show|requeue|purge`` (see :mod:`renqueue.broker._dlq`)."""
    from .broker import DeadLetters, connect

    where = _dlq_filter(args)
    if getattr(args, "seq", None) and not where.empty:
        raise ConfigError("give sequences or filters, not both", path="dlq arguments")
    out = _Output(config)
    nc = await connect(_client_url(config), name="renqueue-dlq", config=config.nats)
    try:
        dead = DeadLetters(nc.jetstream())
        if args.dlq_command == "list":
            return await _dlq_list(dead, where, args, out)
        if args.dlq_command == "show":
            return await _dlq_show(dead, args, out)
        if args.dlq_command == "requeue":
            return await _dlq_requeue(dead, config, where, args, out)
        return await _dlq_purge(dead, where, args, out)
    finally:
        await _close(nc)


class _Output:
    """Lines to stdout and stderr with every configured API key redacted (a
    reason that echoes one, however it got there, never prints it)."""

    def __init__(self, config: Config) -> None:
        self._secrets: list[str] = []
        for backend in config.backends.values():
            with contextlib.suppress(ConfigError):
                key = backend.api_key()
                if key is not None and len(key.reveal()) >= 8:
                    self._secrets.append(key.reveal())

    def _clean(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def line(self, text: str) -> None:
        print(self._clean(text))

    def json(self, value: object) -> None:
        print(self._clean(json.dumps(value)))

    def error(self, text: str) -> None:
        print(self._clean(f"renqueue: {text}"), file=sys.stderr)


def _dlq_filter(args: argparse.Namespace) -> Any:
    from .broker import DeadLetterFilter

    return DeadLetterFilter(
        tenant=getattr(args, "tenant", None),
        reason=getattr(args, "reason", None),
        stage=getattr(args, "stage", None),
        since=getattr(args, "since", None),
        until=getattr(args, "until", None),
        request_id=getattr(args, "request_id", None),
    )


async def _dlq_list(dead: Any, where: Any, args: argparse.Namespace, out: _Output) -> int:
    from .broker import entry_json, render_listing

    listing = await dead.find(where, limit=args.limit)
    if args.json:
        for entry in listing.entries:
            out.json(entry_json(entry))
        return EXIT_OK
    for line in render_listing(listing):
        out.line(line)
    return EXIT_OK


async def _dlq_show(dead: Any, args: argparse.Namespace, out: _Output) -> int:
    from .broker import DeadLetterError, entry_json, render_entry

    failed = False
    for index, seq in enumerate(args.seq):
        try:
            entry = await dead.get(seq)
        except DeadLetterError as exc:
            out.error(str(exc))
            failed = True
            continue
        entry = entry.with_mark(await dead.requeued_as(entry))
        history = await dead.history(entry)
        if args.json:
            out.json(entry_json(entry, history))
            continue
        if index:
            out.line("")
        for line in render_entry(entry, history):
            out.line(line)
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_select(
    dead: Any, where: Any, args: argparse.Namespace, out: _Output
) -> tuple[list[Any], bool]:
    """The entries a requeue or purge acts on: by sequence, or every match of
    the filters (``--all``: every entry); whether some sequence named none."""
    from .broker import DeadLetterError

    if args.seq:
        entries, failed = [], False
        for seq in dict.fromkeys(args.seq):
            try:
                entries.append(await dead.get(seq))
            except DeadLetterError as exc:
                out.error(str(exc))
                failed = True
        return entries, failed
    if where.empty and not args.all:
        raise ConfigError(
            "name the entries: sequences, a filter (--tenant, --reason, --stage, --since, "
            "--until, --id), or --all",
            path="dlq arguments",
        )
    return (await dead.find(where, limit=args.limit)).entries, False


async def _dlq_requeue(
    dead: Any, config: Config, where: Any, args: argparse.Namespace, out: _Output
) -> int:
    from .broker import DeadLetterError
    from .text import clock, printable

    entries, failed = await _dlq_select(dead, where, args, out)
    keep_budget, budget = args.deadline
    # Checked as admission will check it, when there is a config to check against.
    check = config if config.routes else None
    for entry in entries:
        try:
            done = await dead.requeue(entry, budget=budget, keep_budget=keep_budget, config=check)
        except DeadLetterError as exc:
            failed = True
            if args.json:
                out.json({"seq": entry.seq, "ok": False, "error": str(exc)})
            out.error(f"dead letter {entry.seq}: {exc}")
            continue
        if args.json:
            out.json({"seq": entry.seq, "ok": True, **msgspec.to_builtins(done)})
            continue
        deadline = "no deadline" if done.deadline is None else f"deadline {clock(done.deadline)}"
        verb = "already requeued" if done.already else "requeued"
        out.line(
            printable(
                f"dead letter {entry.seq}: {verb} as {done.new_id} "
                f"(tenant {done.tenant}, {deadline})"
            )
        )
    if not entries and not args.json:
        out.line("no dead letters match")
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_purge(dead: Any, where: Any, args: argparse.Namespace, out: _Output) -> int:
    from .broker import DeadLetterError

    entries, failed = await _dlq_select(dead, where, args, out)
    if not entries:
        if not args.json:
            out.line("no dead letters match; nothing purged")
        return EXIT_SOME_FAILED if failed else EXIT_OK
    if not args.yes:
        noun = "dead letter" if len(entries) == 1 else "dead letters"
        print(f"Purge {len(entries)} {noun}? [y/N] ", end="", file=sys.stderr, flush=True)
        answer = await asyncio.to_thread(sys.stdin.readline)
        if not sys.stdin.isatty():
            print(file=sys.stderr)  # the answer was not echoed: end the prompt's line
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing purged", file=sys.stderr)
            return EXIT_SOME_FAILED if failed else EXIT_OK
    purged = 0
    for entry in entries:
        try:
            await dead.purge(entry)
        except DeadLetterError as exc:
            failed = True
            out.error(str(exc))
            continue
        purged += 1
        if args.json:
            out.json({"seq": entry.seq, "purged": True})
    if not args.json:
        out.line(f"purged {purged} dead letter{'' if purged == 1 else 's'}")
    return EXIT_SOME_FAILED if failed else EXIT_OK


def _point_in_time(text: str) -> float:
    """``--since``/``--until``: a duration back from now (``90s``, ``1h``, ``2d``)
    or an ISO 8601 time (UTC unless it names its offset)."""
    from .config import parse_duration

    try:
        return datetime.datetime.now(tz=datetime.UTC).timestamp() - parse_duration(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a duration back from now (30m, 1h, 2d) or an ISO time, got {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def _new_deadline(text: str) -> tuple[bool, float | None]:
    """``--deadline``: ``(keep the original's budget, else this many seconds or None)``."""
    from .config import parse_duration

    if text == "keep":
        return True, None
    if text == "none":
        return False, None
    try:
        return False, parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be keep, none or a duration (60s, 10m), got {text!r}"
        ) from None


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1, got {text!r}")
    return value


def _add_service_commands(sub: Any) -> None:
    """``up``, ``router``, ``worker`` and ``gateway``: the long-running processes."""
    for name, text in (
        ("up", "run embedded NATS (unless --nats), routers, workers (and the gateway)"),
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
    _add_gateway_command(sub)
    cmd = sub.add_parser(
        "exporter",
        help="serve the cluster-wide Prometheus metrics (one scrape target for the cluster)",
        description="Serve what the projection and the broker know of the whole cluster "
        "(docs/metrics.md) on http://HOST:PORT/metrics, joining a running Ren-Queue "
        "(--nats or RENQUEUE_NATS_URL).",
    )
    cmd.add_argument("--port", type=int, required=True, help="listen on this port")
    cmd.add_argument("--host", default="127.0.0.1", help="listen on this address (127.0.0.1)")
    cmd.set_defaults(run=_exporter)


def _add_gateway_command(sub: Any) -> None:
    cmd = sub.add_parser(
        "gateway",
        help="the OpenAI-compatible HTTP gateway (POST /v1/chat/completions, ...)",
        description="Serve the OpenAI-compatible gateway on [gateway] host:port (see "
        "docs/gateway.md), joining a running Ren-Queue (--nats or RENQUEUE_NATS_URL). "
        "`renqueue gateway keygen TENANT` makes an API key.",
    )
    cmd.add_argument("--host", help="listen on this address (default: [gateway] host)")
    cmd.add_argument("--port", type=int, help="listen on this port (default: [gateway] port)")
    cmd.set_defaults(run=_gateway)
    keygen = cmd.add_subparsers(dest="gateway_command").add_parser(
        "keygen",
        help="make an API key for a tenant (or --admin: for the console); print it and its"
        " config entry",
    )
    keygen.add_argument("tenant", type=_tenant_name, nargs="?")
    keygen.add_argument(
        "--admin", action="store_true", help="an admin key, for the web console (/console)"
    )
    keygen.set_defaults(run=_keygen)


def _add_dlq_command(sub: Any) -> None:
    dlq = sub.add_parser(
        "dlq",
        help="the dead-letter stream: list, show, requeue, purge",
        description="What failed for good, with why and the request's history. Exit codes: "
        "0 done, 1 some entries failed, 2 cannot read.",
    )
    commands = dlq.add_subparsers(dest="dlq_command", required=True)

    def filters(cmd: argparse.ArgumentParser, *, limit: int | None) -> None:
        cmd.add_argument("--tenant", help="only this tenant's")
        cmd.add_argument(
            "--reason", help="only those whose reason starts with this (its error type first)"
        )
        cmd.add_argument("--stage", help="only this stage's (requests, dispatch)")
        cmd.add_argument("--id", dest="request_id", help="only this request's")
        cmd.add_argument(
            "--since",
            type=_point_in_time,
            help="stored at or after: a duration back from now (1h) or an ISO time",
        )
        cmd.add_argument("--until", type=_point_in_time, help="stored before (as --since)")
        cmd.add_argument(
            "--limit",
            type=_positive,
            default=limit,
            help="at most this many, the newest" + (f" (default {limit})" if limit else ""),
        )

    def seqs(cmd: argparse.ArgumentParser, nargs: str) -> None:
        cmd.add_argument("seq", type=_positive, nargs=nargs, help="entry (stream sequence)")

    cmd = commands.add_parser("list", help="entries, newest last")
    filters(cmd, limit=100)
    cmd.add_argument("--json", action="store_true", help="one JSON object per entry")

    cmd = commands.add_parser("show", help="entries with headers, payload and history")
    seqs(cmd, "+")
    cmd.add_argument("--json", action="store_true", help="one JSON object per entry")

    cmd = commands.add_parser(
        "requeue",
        help="submit each again as a new request (<id>-dlq<seq>): idempotent, a fresh "
        "attempt budget",
    )
    seqs(cmd, "*")
    filters(cmd, limit=None)
    cmd.add_argument("--all", action="store_true", help="every entry")
    cmd.add_argument(
        "--deadline",
        type=_new_deadline,
        default=(True, None),
        help="keep (default: the original's budget, counted from now), none, or a "
        "duration from now (60s)",
    )
    cmd.add_argument("--json", action="store_true", help="one JSON object per entry")

    cmd = commands.add_parser("purge", help="delete entries (asks first)")
    seqs(cmd, "*")
    filters(cmd, limit=None)
    cmd.add_argument("--all", action="store_true", help="every entry")
    cmd.add_argument("--yes", action="store_true", help="do not ask")
    cmd.add_argument("--json", action="store_true", help="one JSON object per entry purged")

    for cmd in commands.choices.values():
        cmd.set_defaults(run=_guarded(_dlq))


async def _ab(config: Config, args: argparse.Namespace) -> None:
    """``renqueue ab status|promote|rollback|resume`` (see :mod:`renqueue.coordination`)."""
    from .broker import connect
    from .coordination import move_split, planned_move, read_splits, render_splits

    if args.ab_command != "status":  # a move the config cannot make fails before connecting
        planned_move(config, args.route, args.ab_command, getattr(args, "arm", None))
    nc = await connect(_client_url(config), name="renqueue-ab", config=config.nats)
    try:
        js = nc.jetstream()
        if args.ab_command == "status":
            reports = await read_splits(js, config, args.route)
            if args.json:
                print(msgspec.json.encode(reports).decode())
            else:
                print("\n".join(render_splits(reports)))
            return
        event, shown = await move_split(
            js,
            config,
            args.route,
            args.ab_command,
            arm=getattr(args, "arm", None),
            operator=args.by or _operator(),
            reason=args.reason,
        )
    finally:
        await _close(nc)
    from .text import printable

    route = printable(args.route)
    if event is None:
        where = "live" if shown is None or shown.state == "live" else shown.state
        arm = "" if shown is None or not shown.arm else f" ({printable(shown.arm)})"
        print(f"A/B split {route} is {where}{arm} already: nothing logged")
        return
    done = {"live": "resumed", "rolled_back": "rolled back", "promoted": "promoted"}[event.state]
    to = f" to {printable(event.arm)}" if event.arm else ""
    print(f"A/B split {route} {done}{to} (logged as an ab event, by {printable(event.operator)})")
    if shown is None:
        print(
            "the projection has not shown it yet (is a projector running?): routers follow it "
            "once it does"
        )


def _operator() -> str:
    """Who runs the command: ``$USER@host`` (for the ``ab`` event's ``operator``)."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]


def _add_ab_command(sub: Any) -> None:
    ab = sub.add_parser(
        "ab",
        help="A/B splits: status, promote, rollback, resume",
        description="A route's A/B split ([routes.<name>.ab]): each arm's figures, and an "
        "operator's move of its traffic, logged as an ab event every router follows. "
        "Exit codes: 0 done (also when the split is already there), 2 an error.",
    )
    commands = ab.add_subparsers(dest="ab_command", required=True)
    cmd = commands.add_parser("status", help="each split's state and per-arm figures")
    cmd.add_argument("route", nargs="?", help="only this route's split")
    cmd.add_argument("--json", action="store_true", help="the reports as JSON")

    def who(cmd: argparse.ArgumentParser) -> None:
        cmd.add_argument("--reason", default="", help="why (in the event)")
        cmd.add_argument("--by", help="who (default: $USER@host)")

    cmd = commands.add_parser("promote", help="send all of a split's traffic to one arm")
    cmd.add_argument("route")
    cmd.add_argument("arm")
    who(cmd)
    cmd = commands.add_parser("rollback", help="send all of a split's traffic to its control")
    cmd.add_argument("route")
    who(cmd)
    cmd = commands.add_parser(
        "resume", help="split a rolled-back or promoted split's traffic by weight again"
    )
    cmd.add_argument("route")
    who(cmd)
    for cmd in commands.choices.values():
        cmd.set_defaults(run=_guarded(_ab))


def _schema(_config: Config, _args: argparse.Namespace) -> None:
    from .schema import Dispatch, Event, InferenceRequest, TokenChunk

    types: list[Any] = [InferenceRequest, Dispatch, TokenChunk, Event]
    (_schemas, components) = msgspec.json.schema_components(types)
    print(json.dumps({"$defs": components}, indent=2, sort_keys=True))


def _mock_backend(_config: Config, args: argparse.Namespace) -> None:
    from .mock import run_mock_backend

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
            fault_script=args.fault_script,
            fault_repeat=args.fault_repeat,
            fault_rates=args.fault,
            context_window=args.context_window,
            drip_gap=args.drip_gap,
            # One line, the URL last: scripts read it (bench/common.py). The
            # other adapters' base URLs are in the log line before it.
            on_ready=lambda url: print(f"mock backend serving at {url}", flush=True),
        )
    except ValueError as exc:
        raise ConfigError(str(exc), path="mock-backend options") from exc


async def _demo(config: Config, args: argparse.Namespace) -> None:
    from .demo import run_demo

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

    _add_service_commands(sub)

    sub.add_parser("provision", help="apply streams/ to NATS").set_defaults(run=_provision)

    cmd = sub.add_parser("submit", help="submit one request")
    cmd.add_argument("prompt")
    cmd.add_argument("--route", required=True)
    cmd.add_argument("--priority", help="level name (default: config default_priority)")
    cmd.add_argument("--tenant", default="default")
    cmd.add_argument("--id", help="request id (idempotency key)")
    cmd.add_argument("--max-tokens", type=int)
    cmd.add_argument("--timeout", type=float, help="deadline, seconds from now")
    cmd.add_argument(
        "--max-cost", type=float, help="spend ceiling in US dollars (never bound where over it)"
    )
    cmd.add_argument(
        "--complexity", type=int, help="the lowest backend tier that can do the job (0-100)"
    )
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

    cmd = sub.add_parser(
        "status", help="each backend, priority level and tenant now (health, quota, queues)"
    )
    cmd.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    cmd.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        help=f"seconds between redraws (default 2, at least {MIN_INTERVAL:g})",
    )
    cmd.add_argument("--json", action="store_true", help="the report as JSON (one per redraw)")
    cmd.set_defaults(run=_guarded(_status))

    _add_replay_command(sub)

    sub.add_parser("schema", help="JSON Schema of messages and events").set_defaults(run=_schema)

    _add_dlq_command(sub)
    _add_ab_command(sub)

    _add_tool_commands(sub)
    return parser


def _add_replay_command(sub: Any) -> None:
    cmd = sub.add_parser("replay", help="the projection rebuilt from the event log")
    cmd.add_argument(
        "--verify",
        action="store_true",
        help="compare with the live projection and its views, field by field "
        "(exit 0 equal, 1 different, 2 cannot read)",
    )
    cmd.add_argument(
        "--json", action="store_true", help="the rebuilt state (or the result) as JSON"
    )
    cmd.add_argument(
        "--what-if",
        metavar="FILE",
        help="simulate the requests submitted in the window under this config and FILE's, "
        "beside what really happened: cost, deadlines met per level, share per backend",
    )
    cmd.add_argument(
        "--since",
        type=_point_in_time,
        help="with --what-if: requests submitted at or after: a duration back from now "
        "(default 1h) or an ISO time",
    )
    cmd.add_argument(
        "--until", type=_point_in_time, help="with --what-if: submitted before (default: now)"
    )
    cmd.add_argument(
        "--seed", type=_seed, help="with --what-if: seed of the simulated draws (default 0)"
    )
    cmd.set_defaults(run=_guarded(_replay))


def _tenant_name(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        raise argparse.ArgumentTypeError(
            f"a tenant name is 1 to 64 letters, digits, - and _, got {text!r}"
        )
    return text


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_INTERVAL <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds, at least {MIN_INTERVAL:g}, got {text!r}"
        )
    return value


def _add_tool_commands(sub: Any) -> None:
    """The mock backend and the demo: tools around Ren-Queue, not part of it."""
    cmd = sub.add_parser(
        "mock-backend",
        help="mock LLM server: the OpenAI API at /v1, Anthropic at /v1/messages, Ollama at "
        "/api/chat, TGI at /generate_stream, Gemini at /v1beta/models/<m>:streamGenerateContent",
    )
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
    cmd.add_argument(
        "--fault-script",
        default="",
        metavar="KINDS",
        help="faults for chat requests in arrival order, e.g. 500,ok,reset (ok: a normal "
        "answer); kinds: 500 503 529 reset hang drip 429 429_bare quota malformed break "
        "no_done sse_error context_length content_filter filtered",
    )
    cmd.add_argument("--fault-repeat", action="store_true", help="repeat the fault script forever")
    cmd.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND=RATE",
        help="a random fault and its probability, e.g. 503=0.1 (repeatable; seeded by --seed)",
    )
    cmd.add_argument(
        "--context-window", type=int, default=0, help="prompt tokens it accepts (0: any)"
    )
    cmd.add_argument("--drip-gap", type=float, help="seconds between drip tokens (default 5)")
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
            result = asyncio.run(result)
        if isinstance(result, int):
            return result
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
