"""Connecting to NATS with production defaults, and finding which NATS to use.

nats-py's defaults suit a demo, not a service: it gives up reconnecting after
60 attempts (a broker restart longer than ~2 minutes would leave every router
and worker dead), and notices a silently dropped TCP connection only after two
missed pings of two minutes each. Here every connection reconnects forever,
quickly, and pings often enough to notice a dead peer within seconds.

Reconnecting forever has a catch at the *first* connect: nats-py then retries
an unreachable server forever too. :func:`connect` bounds the first attempt
with ``timeout`` and raises :class:`ConnectionFailedError` naming the last
error, so a wrong URL fails clearly instead of hanging. A command line
(``refused_is_final``) does not wait even that long for a port nothing listens
on: a refused connection is an answer, and it fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from ..config import Config, NatsConfig, parse_duration
from ..errors import ConfigError, ConnectionFailedError
from ..logs import get_logger
from ..tasks import Fatal
from ..text import printable
from ._embedded import url_file
from ._nats import Connection

__all__ = ["ConnectionKeeper", "connect", "redact_url", "resolve_nats_url"]

log = get_logger("connection")

#: Pause between reconnect attempts. Short, because the usual cause is a
#: restarting broker or a cluster node moving, both back within a second or two.
RECONNECT_TIME_WAIT = 0.5


def redact_url(url: str) -> str:
    """``nats://user:secret@host:4222`` -> ``nats://***@host:4222`` (for logs and errors)."""
    parts = []
    for one in url.split(","):
        split = urlsplit(one.strip())
        if split.username is not None or split.password is not None:
            netloc = "***@" + split.netloc.rpartition("@")[2]
            parts.append(urlunsplit(split._replace(netloc=netloc)))
        else:
            parts.append(one.strip())
    return ",".join(parts)


def resolve_nats_url(config: Config) -> str | None:
    """Which NATS to use: the configured URL, else a running embedded server's, else ``None``.

    ``None`` means "start the embedded server". The URL from
    ``<data_dir>/nats.url`` is returned without probing it: if that server is
    gone (killed without cleanup), :func:`connect` fails with a clear error
    naming the URL, which beats silently starting a second server on the
    same store.
    """
    if config.nats.url:
        return config.nats.url
    path = url_file(Path(config.nats.data_dir))
    try:
        with path.open("rb") as file:
            raw = file.read(_LONGEST_URL + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConnectionFailedError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        url = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        url = None
    if url is None or len(raw) > _LONGEST_URL or not url.isprintable():
        raise ConfigError(
            f"{path} is damaged (not a URL): remove it, or restart `renqueue up`, which writes it",
            path="$.nats.data_dir",
        )
    return url or None


#: The longest URL file read (``<data_dir>/nats.url``, written by ``up``).
_LONGEST_URL: Final = 4096


def check_url(url: str) -> None:
    """Raise :class:`ConfigError` for a NATS URL (comma-separated for a
    cluster) that no server could have: one that does not parse (a bracket
    left open, a port past 65535), named without its password."""
    for one in url.split(","):
        try:
            urlsplit(one.strip()).port  # noqa: B018 - parses the port, or raises
        except ValueError as exc:
            shown = printable(one.strip().rpartition("@")[2])[:200]
            raise ConfigError(f"not a NATS URL: {shown!r} ({exc})", path="$.nats.url") from None


async def connect(
    url: str,
    *,
    name: str,
    config: NatsConfig | None = None,
    timeout: float = 5.0,  # noqa: ASYNC109 - bounds only the first connect, not the client's life
    inbox_prefix: str | None = None,
    refused_is_final: bool = False,
) -> Connection:
    """Connect to ``url`` (comma-separated for a cluster) as connection ``name``.

    ``timeout`` bounds the first connect, retries included; after that the
    client reconnects forever. ``inbox_prefix`` (default: ``config.inbox_prefix``)
    must be set to the user's allowed inbox prefix when the server restricts
    subscriptions per user, otherwise JetStream acks are denied (see
    ``nats/auth.conf``). Credentials go in the URL (``nats://user:pass@host``)
    or in ``config.credentials_file``.
    Raises :class:`ConnectionFailedError` when no server answers in time, or
    (``refused_is_final``: a command a person waits on) at once when every
    server of ``url`` refused the connection: nothing listens on the port
    (a service keeps trying for ``timeout``, as NATS may be starting beside it).
    """
    check_url(url)
    nats_config = config if config is not None else NatsConfig()
    shown = redact_url(url)
    bound = log.bind(nats_name=name, url=shown)
    last_error: list[BaseException] = []
    client = Connection()
    servers = [one.strip() for one in url.split(",") if one.strip()]
    refused: set[str] = set()
    all_refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        last_error[:] = [exc]
        client.attempt_failed()
        if _refused(exc) and not client.is_connected:
            refused.add(str(exc))  # names the address: one per server refused
            if len(refused) >= len(servers):
                all_refused.set()
        bound.warning("nats error", error=_describe(exc))

    async def on_disconnect() -> None:
        # nats-py reports a deliberate close() as a disconnect too; only an
        # unplanned one deserves a warning.
        if not client.is_closed:
            bound.warning("nats disconnected; reconnecting")

    async def on_reconnect() -> None:
        bound.info("nats reconnected")

    async def on_closed() -> None:
        if client.closed_by_server():
            error = client.last_error
            bound.error(
                "nats closed the connection; it will not reconnect by itself",
                error=_describe(error) if error is not None else None,
            )
        else:
            bound.info("nats connection closed")

    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_TIME_WAIT,
        "ping_interval": parse_duration(nats_config.ping_interval),
        "max_outstanding_pings": 3,
        "connect_timeout": min(2.0, timeout),
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "closed_cb": on_closed,
    }
    if nats_config.credentials_file:
        options["user_credentials"] = nats_config.credentials_file
    inbox_prefix = inbox_prefix or nats_config.inbox_prefix
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix

    try:
        if refused_is_final:
            await _open_unless_refused(client, timeout, options, all_refused, shown)
        else:
            await client.open(timeout, **options)
    except ConnectionFailedError as exc:
        if refused_is_final and all_refused.is_set():
            raise
        cause = last_error[0] if last_error else (exc.__cause__ or exc)
        raise ConnectionFailedError(
            f"cannot connect to NATS at {shown} within {timeout:g}s: {_describe(cause)}"
        ) from exc
    bound.info("nats connected", server=client.connected_server)
    return client


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says nothing listens at the address: a refused
    connection, or (a name with several addresses, IPv6 and IPv4) asyncio's
    ``Multiple exceptions`` of which every one was refused."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    text = str(exc)
    if type(exc) is not OSError or not text.startswith("Multiple exceptions:"):
        return False
    codes = re.findall(r"\[Errno (\d+)\]", text)
    return bool(codes) and all(int(code) == errno.ECONNREFUSED for code in codes)


async def _open_unless_refused(
    client: Connection,
    timeout: float,  # noqa: ASYNC109 - bounds the first connect, as connect's own
    options: dict[str, Any],
    all_refused: asyncio.Event,
    shown: str,
) -> None:
    """``client.open``, given up as soon as every server has refused (``all_refused``)."""
    opening = asyncio.ensure_future(client.open(timeout, **options))
    refusal = asyncio.ensure_future(all_refused.wait())
    try:
        await asyncio.wait({opening, refusal}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refusal.cancel()
        if not opening.done():
            opening.cancel()  # open() closes its half-open client when cancelled
            with contextlib.suppress(asyncio.CancelledError, ConnectionFailedError):
                await opening
    if not opening.cancelled():
        opening.result()
        return
    raise ConnectionFailedError(
        f"cannot reach NATS at {shown} (connection refused): is `renqueue up` running?"
    )


def _describe(exc: BaseException) -> str:
    """An error as ``Type: message`` with any URL credentials redacted."""
    text = str(exc) or type(exc).__name__
    if "@" in text:
        text = " ".join(redact_url(word) if "://" in word else word for word in text.split(" "))
    return f"{type(exc).__name__}: {text}"


class ConnectionKeeper:
    """Keeps a component on a live NATS connection: run :meth:`run` as a
    supervised loop.

    nats-py reconnects by itself after a dropped connection or a server
    restart, but not after the server *closed* the connection (a protocol
    error: ``maximum payload exceeded``, ``Maximum Control Line Exceeded``,
    ...). Then ``renew(new)`` is called with a new connection: the component
    moves what ran on the old one onto it. Opening it, and then the renewal,
    take ``nats.patience`` at most each, or the process stops. A renewal that fails
    part of the way is owed, and done again when the loop restarts. A
    connection that stays down (nats-py reconnecting) longer than
    ``patience`` raises :class:`~renqueue.tasks.Fatal` saying so: the
    process stops, for its supervisor to restart it.
    """

    #: Seconds between looks at the connection.
    EVERY: Final = 1.0

    def __init__(
        self,
        *,
        url: str,
        name: str,
        config: NatsConfig,
        current: Callable[[], Connection | None],
        renew: Callable[[Connection], Awaitable[None]],
    ) -> None:
        self._url = url
        self._name = name
        self._config = config
        self._current = current
        self._renew = renew
        self._owed = False
        #: Times a new connection was opened and the component moved onto it.
        self.renewals = 0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        down_since: float | None = None
        while True:
            nc = self._current()
            if nc is None:
                raise Fatal(f"{self._name} has no connection to keep")
            if not self._owed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.EVERY):  # no task made for each look
                        await nc.lost.wait()
            if nc.lost.is_set() or nc.closed_unasked or self._owed:
                await self._renewed(nc)
                down_since = None
            elif nc.is_connected:
                down_since = None
            elif down_since is None:
                down_since = loop.time()
            elif loop.time() - down_since > self._config.patience_seconds:
                raise Fatal(
                    f"cannot reach NATS at {redact_url(self._url)} for longer than "
                    f"nats.patience ({self._config.patience})"
                )

    async def _renewed(self, old: Connection) -> None:
        log.warning("moving onto a new NATS connection", nats_name=self._name)
        self._owed = True
        if not old.is_closed:
            with contextlib.suppress(Exception):
                await old.close()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._config.patience_seconds
        while True:
            try:
                new = await connect(self._url, name=self._name, config=self._config)
                break
            except ConnectionFailedError as exc:
                if loop.time() >= give_up:
                    raise Fatal(
                        f"cannot reconnect to NATS within nats.patience "
                        f"({self._config.patience}): {exc}"
                    ) from exc
                log.warning("reconnecting to NATS failed; trying again", error=str(exc))
        # The renewal has the whole patience of its own: the outage is over.
        patience = self._config.patience_seconds
        try:
            async with asyncio.timeout(None if math.isinf(patience) else patience):
                await self._renew(new)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await new.close()
            if isinstance(exc, TimeoutError):
                raise Fatal(
                    f"could not start again on a new NATS connection within nats.patience "
                    f"({self._config.patience})"
                ) from exc
            raise
        self._owed = False
        self.renewals += 1
        log.info("running on a new NATS connection", nats_name=self._name)
