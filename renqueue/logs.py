"""Structured logging that stays silent in a library and speaks in the CLI.

Every Ren-Queue module logs through :func:`get_logger`: a structlog logger
whose lines go to the standard library logger ``renqueue.<component>``.
Ren-Queue never configures logging on import. A program that uses the
:class:`~renqueue.Client` and configures nothing sees nothing (the
``renqueue`` logger has a ``NullHandler``, as the logging HOWTO asks of
libraries); a program that configures stdlib logging (``logging.basicConfig``)
gets the lines there, as ``event key=value ...`` messages, each record also
carrying the structured fields as ``record.renqueue_event``.

The ``renqueue`` command calls :func:`configure_logging`: one handler on the
root logger, JSON lines in production, pretty on a terminal, on stderr. A
handler that cannot write (stderr is a pipe whose reader went away, as with
``renqueue up 2>&1 | tee up.log`` after Ctrl-C) drops its lines instead of
raising into the code that logs, so a shutdown always runs to its end.

The request id is bound through contextvars (``bound_request``), so every line
logged while a request is handled carries it. Secrets never reach a log line:
config values that hold credentials are :class:`~renqueue.config.Secret` and
print as ``***``; NATS URLs are logged through
:func:`renqueue.broker.redact_url`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import IO, Any, Final

import structlog

__all__ = ["EVENT_ATTRIBUTE", "bound_request", "configure_logging", "get_logger", "misdirected"]

#: The stdlib logger every Ren-Queue component logs under (``renqueue.<component>``).
ROOT_LOGGER: Final = "renqueue"
#: Attribute of a ``logging.LogRecord`` holding the structured event (a dict).
EVENT_ATTRIBUTE: Final = "renqueue_event"

# A library adds no handler but a NullHandler (logging HOWTO, "Configuring
# Logging for a Library"): without it, warnings would reach stderr through
# logging.lastResort in a program that configured nothing.
logging.getLogger(ROOT_LOGGER).addHandler(logging.NullHandler())


def _to_stdlib(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Last processor: a readable message for plain handlers, the fields for ours."""
    fields = dict(event_dict)
    exc_info = fields.pop("exc_info", None)
    event = fields.get("event", "")
    details = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("event", "component"))
    message = f"{event} {details}" if details else str(event)
    kwargs: dict[str, Any] = {"extra": {EVENT_ATTRIBUTE: fields}}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (message,), kwargs


_PROCESSORS: Final[list[Any]] = [
    structlog.stdlib.filter_by_level,  # drop below-level calls before any work
    structlog.contextvars.merge_contextvars,
    _to_stdlib,
]


def get_logger(name: str) -> Any:
    """A structlog logger carrying ``component=name``, logging to ``renqueue.<name>``.

    It does not depend on structlog's global configuration, so neither a
    program's own structlog set-up nor its absence changes where Ren-Queue's
    lines go: stdlib logging decides.
    """
    return structlog.wrap_logger(
        logging.getLogger(f"{ROOT_LOGGER}.{name}"),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        cache_logger_on_first_use=True,
        component=name,
    )


class _Formatter(logging.Formatter):
    """Renders a record the way the CLI always has: structlog's console or JSON renderer."""

    def __init__(self, renderer: Any) -> None:
        super().__init__()
        self._processors: list[Any] = [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ]

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, EVENT_ATTRIBUTE, None)
        if isinstance(fields, dict):
            event: Any = dict(fields)
        else:  # a record from another library, through the root logger
            event = {"event": record.getMessage(), "logger": record.name}
        if record.exc_info and "exc_info" not in event:
            event["exc_info"] = record.exc_info
        method = record.levelname.lower()
        for processor in self._processors:
            event = processor(None, method, event)
        return str(event)


class _StreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that goes quiet, not loud, when its stream is gone.

    Once a write fails with an OS error (EPIPE: the reader of the pipe went
    away) or on a closed file, every later line is dropped: nothing raises
    into the code that logs, and no "--- Logging error ---" report is
    attempted on the same dead stream.
    """

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self.broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError | ValueError):
            self.broken = True
            return
        super().handleError(record)


def configure_logging(
    *, level: str = "INFO", json: bool | None = None, stream: IO[str] | None = None
) -> None:
    """Set up logging for an application (the ``renqueue`` command, the benchmarks).

    One handler on the root logger writing to ``stream`` (default: stderr):
    Ren-Queue's lines at ``level``, other libraries' at ``WARNING`` or above.
    ``json=None`` picks JSON unless the stream is a terminal, whose lines are
    coloured unless ``$NO_COLOR`` is set (https://no-color.org). structlog's own
    default (print to stdout) is replaced too, so any ``structlog.get_logger()``
    in the application lands on the same handler. Calling it again replaces
    the earlier set-up.
    """
    out = sys.stderr if stream is None else stream
    tty = out.isatty()
    use_json = not tty if json is None else json
    # https://no-color.org: NO_COLOR set and not empty turns colours off.
    renderer: Any = structlog.dev.ConsoleRenderer(colors=tty and not os.environ.get("NO_COLOR"))
    if use_json:
        renderer = structlog.processors.JSONRenderer()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(  # noqa: TRY004 - a bad value, not a bad type
            f"unknown log level {level!r}: use DEBUG, INFO, WARNING or ERROR"
        )
    handler = _StreamHandler(out)
    handler.setFormatter(_Formatter(renderer))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StreamHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(numeric, logging.WARNING))
    logging.getLogger(ROOT_LOGGER).setLevel(numeric)
    structlog.configure(
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        context_class=dict,
        cache_logger_on_first_use=True,
    )


@contextmanager
def bound_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Bind ``request_id`` (and more) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **fields):
        yield


def misdirected(receiver: str, subject: str, **fields: object) -> None:
    """Drop a message that ``receiver`` must not act on: count it and say so.

    ``receiver`` is a fixed name (``tap``, ``tokens``, ``events``, ``read``,
    ``boost``, ``capacity``, ``preempt``, ``offers``, ``cancels``,
    ``projection``): never an id. The count is
    ``renqueue_misdirected_messages_total`` (:data:`renqueue.metrics.MISDIRECTED`).
    """
    # Imported here: the metrics load prometheus_client, which a client process
    # (`import renqueue`) then loads only once it drops a message.
    from .metrics import MISDIRECTED  # noqa: PLC0415

    MISDIRECTED.labels(receiver).inc()
    get_logger("security").warning(
        "message on an unexpected subject dropped", receiver=receiver, subject=subject, **fields
    )
