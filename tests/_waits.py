"""Waiting for the event that matters, in tests that poll for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest


async def until(check: Callable[[], Awaitable[bool]], what: str, within: float = 30.0) -> None:
    """Poll ``check()`` until it holds; fail naming ``what`` after ``within`` seconds
    (a bound for a broken run, not a timing: a passing run waits only for the event)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {within} s waiting until {what}")
        await asyncio.sleep(0.02)
