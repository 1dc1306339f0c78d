"""The ``renqueue`` command line: one module per command, on Click, printed with Rich.

Why Click (not Typer on it, not argparse): every command here is a thin
synchronous shell around an asyncio service or client call (``asyncio.run``
once, at the command's edge), so what the library must do well is parsing,
not running coroutines; Click does that with explicit decorators that mypy
--strict checks as they are, global options given to every command (so they
work before or after its name), help that shows each option's default, and
``standalone_mode=False`` to keep ``main(argv) -> int`` for the tests. Typer
would add a layer of type-hint inference over the same Click objects, and its
``Annotated`` options are harder to share across commands. Rich draws the
tables and timelines (``audit``, ``dlq show``).

::

    renqueue init [PATH]        a starter renqueue.toml
    renqueue up [--mocks]       embedded NATS (unless --nats) + routers + workers (+ gateway)
    renqueue router | worker    scale out: routers only, or workers (-b NAME) only
    renqueue gateway            the OpenAI-compatible HTTP gateway; `gateway keygen TENANT`
    renqueue exporter --port P  the cluster-wide Prometheus metrics
    renqueue provision          apply streams/ to NATS, idempotently
    renqueue submit PROMPT      one request (-f FILE, - for stdin, --messages FILE)
    renqueue cancel ID          cancel a request
    renqueue audit ID           one request's timeline
    renqueue status             each backend, level and tenant now (--watch)
    renqueue replay             the projection rebuilt (--verify, --what-if FILE)
    renqueue dlq ...            the dead letters: list, show, requeue, purge
    renqueue ab ...             A/B splits: status, promote, rollback, resume
    renqueue schema             JSON Schema of every wire message and event
    renqueue mock-backend       a mock LLM server
    renqueue demo               everything embedded, a mixed workload, a summary

Exit codes (docs/cli.md): 0 done; 2 usage or config error (an unknown route
or level, a bad option, a prompt over the limit); 3 the request failed,
expired, was cancelled or rejected (``cancel``: it had already ended
otherwise), or no such request (``cancel``, ``audit``); 4 NATS unreachable or
lost, or ``--wait`` ran out. ``replay --verify`` exits 1 when the projections
differ, ``dlq`` 1 when some entries failed; Ctrl-C 130; a closed stdout 141.
"""

from __future__ import annotations

from ._app import main
from ._common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_UNREACHABLE,
    EXIT_UNSUCCESSFUL,
    EXIT_WAIT_TIMEOUT,
)

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "EXIT_UNREACHABLE",
    "EXIT_UNSUCCESSFUL",
    "EXIT_WAIT_TIMEOUT",
    "main",
]
