"""Structured logging: JSON lines in production, pretty on a terminal.

The request id is bound through contextvars (``bound_request``), so every line
logged while a request is handled carries it. Secrets never reach a log line:
config values that hold credentials are :class:`~renqueue.config.Secret` and
print as ``***``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

__all__ = ["bound_request", "configure_logging", "get_logger"]


def configure_logging(*, level: str = "INFO", json: bool | None = None) -> None:
    """Set up structlog. ``json=None`` picks JSON unless stderr is a terminal."""
    use_json = not sys.stderr.isatty() if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> Any:
    """A structlog logger carrying ``component=name``."""
    return structlog.get_logger(component=name)


@contextmanager
def bound_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Bind ``request_id`` (and more) to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **fields):
        yield
