"""Owning background tasks: cancel them for sure.

Python 3.11's ``asyncio.wait_for`` (which nats-py uses inside ``fetch`` and
``next_msg``) can swallow a cancellation that arrives together with a reply:
the task carries on as if never cancelled. A single ``cancel()`` followed by an
unbounded wait can then hang a shutdown forever (seen in the router: 9 stops in
40). :func:`cancel_and_wait` repeats the cancel until every task has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], *, every: float = 0.2) -> None:
    """Cancel ``tasks`` and wait until all have ended, cancelling again every ``every`` s.

    Exceptions the tasks end with are retrieved (not raised): a loop that died
    of an error is already over, which is all a shutdown needs.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=every)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # mark retrieved: no "exception never retrieved" noise
