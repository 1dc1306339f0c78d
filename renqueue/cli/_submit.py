"""``submit`` and ``cancel``: one request, from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, Final

import click
import msgspec

from ..config import Config
from ..errors import (
    ConfigError,
    ConnectionFailedError,
    NatsUnavailableError,
    RenQueueError,
    RequestCancelledError,
    RequestFailedError,
    StoreFullError,
)
from ..schema import MAX_DEADLINE_AHEAD, MAX_TEXT
from ._app import cli, command, globals_of, setup
from ._common import (
    SECONDS,
    Finite,
    Interrupted,
    NoSuchRequest,
    RequestIdName,
    TenantName,
    Unreachable,
    WaitTimeout,
    client_url,
    close_client,
    reach,
)


def _param(text: str) -> tuple[str, Any]:
    """``--param k=v``: the value as JSON when it reads as JSON, else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"must be KEY=VALUE, got {text!r}", param_hint="--param")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value
    except RecursionError:
        raise click.BadParameter(f"{key} is nested too deeply", param_hint="--param") from None


@command(
    cli,
    "submit",
    short_help="Submit one request and print its answer.",
    epilog='Examples: renqueue submit "hello" --wait 30; echo hi | renqueue submit - --stream; '
    "renqueue submit -f prompt.txt --system 'Be brief.' --param temperature=0.2",
)
@click.argument("prompt", required=False)
@click.option(
    "-f",
    "--file",
    "prompt_file",
    type=click.Path(dir_okay=False, path_type=Path, allow_dash=True),
    help="Read the prompt from this file (- : stdin). PROMPT '-' reads stdin too.",
)
@click.option("--system", help="A system message before the prompt.")
@click.option(
    "--messages",
    "messages_file",
    type=click.Path(dir_okay=False, path_type=Path, allow_dash=True),
    help="A JSON file with the whole conversation: a list of {role, content} messages.",
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help='A generation parameter (temperature=0.2, stop=["\\n"], top_k=40); repeatable.',
)
@click.option("--route", help="Route (model group) to run on (default: the config's first).")
@click.option("--priority", help="Priority level (default: the config's default_priority).")
@click.option("--tenant", type=TenantName(), default="default", help="Tenant the request is for.")
@click.option(
    "--id",
    "request_id",
    type=RequestIdName(),
    help="Request id, the idempotency key (default: random).",
)
@click.option("--max-tokens", type=click.IntRange(min=1), help="Answer length cap (tokens).")
@click.option(
    "--timeout",
    type=Finite(min=0, min_open=True, max=MAX_DEADLINE_AHEAD),
    help="Deadline, seconds from now, at most 30 days (default: none).",
)
@click.option(
    "--max-cost",
    type=Finite(min=0),
    help="Spend ceiling in US dollars (never bound where over it; default: none).",
)
@click.option(
    "--complexity",
    type=click.IntRange(0, 100),
    help="The lowest backend tier that can do the job (0-100).",
)
@click.option(
    "--wait",
    type=SECONDS,
    help="Bound on the whole command in seconds, connecting included (default: no bound).",
)
@click.option("--stream", is_flag=True, help="Print tokens as they come.")
@click.pass_context
def submit(ctx: click.Context, /, **options: Any) -> None:
    """Submit one request and wait for its answer: the prompt from PROMPT, a
    file (-f), or stdin (-), or a whole conversation (--messages). An unknown
    route or level is refused before anything is sent."""
    started = time.monotonic()
    config = setup(ctx)
    options["json"] = globals_of(ctx).json
    _utf8(options["prompt"], "PROMPT")
    _utf8(options["system"], "--system")
    wait = options["wait"]
    messages = _messages(options, deadline=None if wait is None else started + wait)
    _within_limits(messages, options["system"])
    route, priority = _checked(config, options["route"], options["priority"])
    params = dict(_param(text) for text in options["params"])
    generation = _generation(params, options["max_tokens"])
    request = {
        "prompt": messages,
        "route": route,
        "priority": priority,
        "request_id": options["request_id"],
        "system": options["system"] if isinstance(messages, str) else None,
        "max_tokens": None if generation else options["max_tokens"],
        "params": generation,
        "timeout": options["timeout"],
        "max_cost": options["max_cost"],
        "complexity": options["complexity"],
    }
    progress: dict[str, Any] = {}
    run = _submit(config, options, request, progress)
    try:
        asyncio.run(_bounded(run, options["wait"], progress))
    except KeyboardInterrupt:
        request_id = progress.get("id")
        if request_id is None:
            raise Interrupted("interrupted before the request was submitted") from None
        raise Interrupted(
            f"interrupted; request {request_id} goes on (follow it with "
            f"`renqueue audit {request_id}`, or `renqueue cancel {request_id}`)"
        ) from None


def _messages(options: dict[str, Any], *, deadline: float | None) -> str | list[dict[str, Any]]:
    """The prompt as text, or the conversation (``--messages``, ``--system``),
    read by ``deadline`` (``--wait``'s end)."""
    prompt, file, messages_file = (
        options["prompt"],
        options["prompt_file"],
        options["messages_file"],
    )
    given = sum(x is not None for x in (prompt, file, messages_file))
    if given != 1:
        raise click.UsageError("give one of PROMPT, -f FILE (or - for stdin), --messages FILE")
    if messages_file is not None:
        text = _read(messages_file, most=_MESSAGES_BYTES, deadline=deadline, what="--messages")
        try:
            # msgspec: no NaN, and a depth bound rather than a RecursionError.
            conversation = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--messages") from None
        except RecursionError:
            raise click.BadParameter("nested too deeply", param_hint="--messages") from None
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            raise click.BadParameter(
                "must be a JSON list of {role, content} objects", param_hint="--messages"
            )
        if options["system"]:
            conversation = [{"role": "system", "content": options["system"]}, *conversation]
        return conversation
    if prompt in (None, "-"):
        # As the shell's $(...) does: a file's (or stdin's) last newline ends
        # the file, it is not part of the prompt. Only one: the rest is text.
        source = file if file is not None else Path(prompt)
        what = "PROMPT" if file is None else "-f"
        text = _read(source, most=_PROMPT_BYTES, deadline=deadline, what=what)
        text = text.removesuffix("\n").removesuffix("\r")
    else:
        text = prompt
    if not text.strip():
        raise click.UsageError("the prompt is empty")
    return text


def _within_limits(messages: str | list[dict[str, Any]], system: str | None) -> None:
    """Refuse, before connecting, a message longer than a request may carry
    (:data:`renqueue.schema.MAX_TEXT` characters), in one line with the limit."""
    if isinstance(messages, str):
        texts = [("the prompt", messages), ("--system", system or "")]
    else:
        texts = [
            (f"--messages item {n}", m["content"])
            for n, m in enumerate(messages, 1)
            if isinstance(m.get("content"), str)
        ]
    for what, body in texts:
        if len(body) > MAX_TEXT:
            raise PromptTooLarge(
                f"{what} is {len(body):,} characters, over the {MAX_TEXT:,} a message may "
                "have (and a whole request must fit the broker's max_payload, 8 MB for the "
                "server `renqueue up` starts): shorten it, or split it into several requests"
            )


class PromptTooLarge(RenQueueError):
    """A message longer than a request may carry (exit 2, nothing sent)."""


#: The most a prompt file or stdin may hold: a message has at most
#: :data:`~renqueue.schema.MAX_TEXT` characters, 4 bytes each at most in UTF-8
#: (and a last CR LF). A stream that goes on past it is refused unread.
_PROMPT_BYTES: Final = 4 * MAX_TEXT + 2
#: The most a ``--messages`` file may hold: NATS carries no message over 64 MiB.
_MESSAGES_BYTES: Final = 64 * 1024 * 1024


def _read(path: Path, *, most: int, deadline: float | None, what: str) -> str:
    """``path`` (``-``: stdin) as UTF-8 text: at most ``most`` bytes (a stream
    that never ends, ``/dev/zero``, is refused there, not read for ever) and
    until ``deadline`` (``time.monotonic()``; ``--wait`` bounds a stdin that
    never ends too). A usage error, in one line, for what cannot be read."""
    fd, owned, name = _opened(path, what)
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= most:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise WaitTimeout(
                        f"{name} did not end within the --wait bound: nothing was submitted"
                    )
            chunk = os.read(fd, min(1 << 20, most + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {name}: {exc.strerror}") from None
    finally:
        if owned:
            os.close(fd)
    if size > most:
        if most == _PROMPT_BYTES:
            raise PromptTooLarge(
                f"{name} holds more than {MAX_TEXT:,} characters, the most a message may "
                "have: shorten it, or split it into several requests"
            )
        raise click.BadParameter(
            f"{name} is over {most // (1024 * 1024)} MiB, more than NATS carries in a message",
            param_hint=what,
        )
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"{name} is not UTF-8 text (byte {exc.start})", param_hint=what
        ) from None


def _opened(path: Path, what: str) -> tuple[int, bool, str]:
    """``path``'s file descriptor (``-``: stdin's), whether it is ours to close, its name."""
    if str(path) != "-":
        try:
            return os.open(path, os.O_RDONLY), True, str(path)
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror}") from None
    try:
        return (sys.stdin or sys.__stdin__).fileno(), False, "stdin"  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError):
        raise click.BadParameter("cannot read stdin: it is closed", param_hint=what) from None


def _utf8(text: str | None, what: str) -> None:
    """Refuse text the shell passed that is not UTF-8 (an argument's bad bytes
    reach Python as lone surrogates, which no JSON can carry)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise click.BadParameter(
            f"is not UTF-8 text (character {exc.start + 1})", param_hint=what
        ) from None


def _checked(config: Config, route: str | None, priority: str | None) -> tuple[str, str]:
    """The route and level, checked against the config before anything is sent."""
    routes = list(config.routes)
    if route is None:
        if not routes:
            raise ConfigError(
                "no route given and the config has none: give --route, or -c a config "
                "with [routes.<name>]",
                path="$.routes",
            )
        route = routes[0]
    elif routes and route not in config.routes:
        raise ConfigError(
            f"no route {route!r}; the config's routes: {', '.join(routes)}", path="$.routes"
        )
    level = priority or config.default_priority
    if level not in config.priorities:
        raise ConfigError(
            f"no priority level {level!r}; the config's levels: {', '.join(config.priorities)}",
            path="$.priorities",
        )
    return route, level


async def _bounded(run: Any, wait: float | None, progress: dict[str, Any]) -> None:
    """``run`` within ``wait`` seconds, whatever it waits on: connecting, the
    submit, the tokens, the result, a connection lost on the way."""
    if wait is None:
        await run
        return
    try:
        async with asyncio.timeout(wait):
            await run
    except TimeoutError as exc:
        request_id = progress.get("id")
        if request_id is None:
            raise Unreachable(
                f"could not submit within {wait:g} s (the --wait bound): NATS at "
                f"{progress.get('url')} did not answer"
            ) from exc
        if progress.get("lost"):
            raise Unreachable(
                f"lost NATS at {progress.get('url')} while waiting for request {request_id}; "
                f"gave up after {wait:g} s (the --wait bound)"
            ) from exc
        raise WaitTimeout(
            f"request {request_id} has not ended after {wait:g} s; it goes on "
            f"(follow it with `renqueue audit {request_id}`)"
        ) from exc


def _generation(params: dict[str, Any], max_tokens: int | None) -> Any:
    """``--param`` items as the request's parameters (unknown ones in ``extra``)."""
    from ..schema import MAX_JSON_DEPTH, RESERVED_EXTRA, GenerationParams, too_deep

    if not params:
        return None
    if max_tokens is not None:
        params.setdefault("max_tokens", max_tokens)
    known = set(GenerationParams.__struct_fields__)
    fields: dict[str, Any] = {k: v for k, v in params.items() if k in known}
    extra = {k: v for k, v in params.items() if k not in known}
    # Refused here, before anything is sent, as the router would refuse them
    # after (exit 3, a rejected request in the log).
    reserved = sorted(set(extra) & RESERVED_EXTRA)
    if reserved:
        raise click.BadParameter(
            f"{', '.join(reserved)} cannot be set: Ren-Queue sets it, or it would change "
            "the call's cost, model or what the provider keeps (use --route, --stream, "
            "--max-tokens)",
            param_hint="--param",
        )
    if too_deep(extra):
        raise click.BadParameter(
            f"nested deeper than {MAX_JSON_DEPTH} levels", param_hint="--param"
        )
    if extra:
        fields["extra"] = extra
    try:
        return msgspec.convert(fields, GenerationParams)
    except msgspec.ValidationError as exc:
        raise click.BadParameter(str(exc), param_hint="--param") from None


async def _submit(
    config: Config, options: dict[str, Any], request: dict[str, Any], progress: dict[str, Any]
) -> None:
    """Submit and follow the request; ``progress`` says how far it got (the
    URL, the connection, the request's id) for a ``--wait`` that runs out."""
    from ..client import Client

    progress["url"] = url = client_url(config)
    try:
        nc = await reach(config, "renqueue-cli")
    except ConnectionFailedError as exc:
        raise Unreachable(str(exc)) from exc
    client = Client(nc, tenant=options["tenant"], owns_connection=True)
    try:
        handle = await client.submit(**request)
        progress["id"] = handle.id
        result = await _follow(handle, stream=options["stream"], as_json=options["json"])
    except StoreFullError:
        raise  # the broker answered: refused, not unreachable (exit 3)
    except NatsUnavailableError as exc:
        raise Unreachable(f"lost NATS at {url}: {exc}") from exc
    except asyncio.CancelledError:
        # --wait ran out: say whether the connection was there at that moment.
        progress["lost"] = not client.nc.is_connected
        raise
    finally:
        await close_client(client)
    if options["json"]:
        print(json.dumps(msgspec.to_builtins(result)))
        return
    if not options["stream"]:
        print(result.text)
    print(
        f"-- backend={result.backend} tokens={result.usage.prompt_tokens}+"
        f"{result.usage.completion_tokens} cost=${result.cost:.6f} "
        f"duration={result.duration:.3f}s"
    )


async def _follow(handle: Any, *, stream: bool, as_json: bool) -> Any:
    """The request's tokens (``stream``: printed as they come), then its result."""
    if not as_json:
        again = " (already submitted)" if handle.duplicate else ""
        print(f"request {handle.id}{again}", file=sys.stderr, flush=True)
    if stream:
        async for chunk in handle.stream():
            if as_json:
                print(json.dumps(msgspec.to_builtins(chunk)), flush=True)
                continue
            if chunk.restart:
                print("\n[restarted]", flush=True)
            print(chunk.text, end="", flush=True)
        if not as_json:
            print()
    return await handle.result()


#: The events that end a request.
_TERMINAL = frozenset({"completed", "failed", "expired", "cancelled", "rejected"})


@command(
    cli,
    "cancel",
    short_help="Cancel a request: a queued one never runs, a running one is stopped.",
    epilog="Example: renqueue cancel req-42 --wait 10",
)
@click.argument("request_id", type=RequestIdName())
@click.option("--tenant", type=TenantName(), default="default", help="Tenant the request is for.")
@click.option("--reason", default="", help="Why (kept in the cancelled event).")
@click.option(
    "--wait",
    type=SECONDS,
    help="Wait up to this many seconds for the request to end (default: do not wait).",
)
@click.pass_context
def cancel(
    ctx: click.Context, request_id: str, tenant: str, reason: str, wait: float | None
) -> None:
    """Cancel REQUEST_ID. Exit 0 when it is cancelled (or the cancellation is
    recorded, without --wait), 3 when it had already ended otherwise."""
    config = setup(ctx)
    say = _said(request_id, as_json=globals_of(ctx).json)
    asyncio.run(_cancel(config, request_id, tenant, reason=reason, wait=wait, say=say))


def _said(request_id: str, *, as_json: bool) -> Any:
    """How ``cancel`` says where the request is: a line, or (--json) one document
    ``{"id": ..., "state": ...}`` (``already_cancelled``, ``requested``, ``cancelled``)."""

    def say(state: str, text: str, *, last: bool = True) -> None:
        if not as_json:
            print(text)
        elif last:
            print(json.dumps({"id": request_id, "state": state}))

    return say


async def _cancel(
    config: Config,
    request_id: str,
    tenant: str,
    *,
    reason: str,
    wait: float | None,
    say: Any,
) -> None:
    from ..broker import submitted_of
    from ..client import Client
    from ..schema import kind_of

    client = Client(await reach(config, "renqueue-cli"), tenant=tenant, owns_connection=True)
    try:
        handle = client.handle(request_id)
        if await submitted_of(client.js, tenant, handle.id) is None:
            # Refused, nothing recorded: a cancellation of an id never
            # submitted would wait in the log for a request that may never
            # come. One submitted a moment ago that no router has logged yet
            # is refused too (say so): it can be cancelled once it is.
            raise NoSuchRequest(
                f"no request {handle.id} is known for tenant {tenant!r}: it was never "
                "submitted (check the id and --tenant), or it was submitted a moment ago and "
                "no router has logged it yet (try again)",
                request_id=handle.id,
                tenant=tenant,
            )
        known = await handle.events()
        ended = next((event for event in reversed(known) if kind_of(event) in _TERMINAL), None)
        if ended is not None:
            kind = kind_of(ended)
            if kind == "cancelled":
                say("already_cancelled", f"request {handle.id} was already cancelled")
                return
            backend = getattr(ended, "backend", None)
            where = f" on {backend}" if backend else ""
            raise RequestFailedError(
                f"it had already {kind}{where}: nothing to cancel",
                request_id=handle.id,
                error_type=kind,
            )
        await handle.cancel(reason)
        # A person sees the request asked for at once; --json, only how it ended.
        say("requested", f"cancellation requested for {handle.id}", last=wait is None)
        if wait is None:
            return
        try:
            async with asyncio.timeout(wait):
                result = await handle.result()
        except TimeoutError as exc:
            raise WaitTimeout(
                f"request {handle.id} has not ended after {wait:g} s; it goes on "
                f"(follow it with `renqueue audit {handle.id}`)"
            ) from exc
        except RequestCancelledError:
            say("cancelled", f"request {handle.id} cancelled")
            return
        raise RequestFailedError(
            f"already ended: completed on {result.backend} before the cancellation",
            request_id=handle.id,
            error_type="completed",
        )
    finally:
        await close_client(client)
