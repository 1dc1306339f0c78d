"""Clocks that start near zero (issue #25).

A machine's monotonic clock counts from its boot. Code that says "never" as
0.0 and compares a fresh reading with it takes "never" for "just now" for a
while after every boot: a router started then skipped its first capacity read,
and the suite failed on freshly booted CI machines. These tests pin that no
component does so: each runs with a clock that starts at 0, the whole suite
runs on an event loop whose clock starts at 0 (``conftest.FreshBootLoop``),
and a syntax check finds any new zero sentinel of a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _clock_sentinels import find, find_in_source
from _waits import until
from test_projection import events_js, publish, started, stored

from renqueue.broker import JetStream
from renqueue.coordination import Lease, Projector
from renqueue.errors import NatsNotFoundError

__all__ = ["events_js"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parent.parent


def test_no_code_takes_a_clock_reading_of_0_for_never() -> None:
    """Every module of the package and the examples. (bench/ is left out: its
    meters set their start before they read it, and a sentinel there can cost
    a number, not a service.)"""
    paths = [*(ROOT / "renqueue").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    assert len(paths) > 50
    assert [str(s) for s in find(paths, ROOT)] == []


@pytest.mark.parametrize(
    "source",
    [
        # The bugs of issue #25, in their own words.
        """
        class Capacity:
            def __init__(self, config):
                self._at = dict.fromkeys(config.backends, 0.0)
            def refresh(self, name):
                now = time.monotonic()
                if now - self._at[name] >= self._refresh:
                    self._at[name] = now
        """,
        """
        class Client:
            def __init__(self):
                self._tap_seen = 0.0
            async def on_tap(self):
                self._tap_seen = asyncio.get_running_loop().time()
        """,
        """
        class Projector:
            def __init__(self, clock):
                self._clock = clock
                self._last_write = 0
            def flush(self):
                self._last_write = self._clock()
        """,
        # A deadline from a loop time, a default read of a dict, `or 0.0`.
        """
        class Router:
            def __init__(self):
                self._until = -0.0
            async def sit_out(self, loop):
                self._until = loop.time() + 5
        """,
        """
        class Seen:
            def see(self, key):
                self._seen[key] = time.perf_counter()
            def age(self, key):
                return time.perf_counter() - self._seen.get(key, 0.0)
        """,
        """
        class Seen:
            def see(self):
                self._last = max(self._last or 0.0, time.monotonic())
        """,
        # A struct field that defaults to 0 and is given a monotonic reading.
        """
        class Mark(msgspec.Struct):
            at: float = 0.0
        def mark(loop):
            began = loop.time()
            return Mark(at=began)
        """,
        """
        class Counts:
            def __init__(self):
                self._at = collections.defaultdict(float)
            def read(self, name):
                self._at[name] = time.monotonic()
        """,
    ],
)
def test_the_check_finds_a_zero_sentinel_of_a_clock(source: str) -> None:
    assert find_in_source(textwrap.dedent(source)) != []


@pytest.mark.parametrize(
    "source",
    [
        # Never said as such.
        """
        class Capacity:
            def __init__(self, config):
                self._at = dict.fromkeys(config.backends, -math.inf)
                self._read = None
            def refresh(self, name):
                now = time.monotonic()
                self._at[name] = now
                self._read = now
        """,
        # A count or a duration that starts at 0 is no sentinel.
        """
        class Meter:
            def __init__(self):
                self.reads = 0
                self.elapsed = 0.0
            def read(self):
                began = time.monotonic()
                self.reads += 1
                self.elapsed += time.monotonic() - began
        """,
        # Wall-clock times: 0.0 is 1970, long ago indeed.
        """
        class Watch:
            def __init__(self, clock=time.time):
                self._clock = clock
                self._since = 0.0
            def see(self):
                self._since = self._clock()
        """,
        """
        class Event(msgspec.Struct):
            at: float = 0.0
        def make():
            return Event(at=time.time())
        """,
    ],
)
def test_the_check_leaves_alone_what_is_no_sentinel(source: str) -> None:
    assert find_in_source(textwrap.dedent(source)) == []


async def test_the_suite_runs_on_a_loop_whose_clock_started_at_zero() -> None:
    """``conftest.FreshBootLoop``: the session's loop counts from its own start,
    so every test reads a loop time a freshly booted machine would give."""
    loop = asyncio.get_running_loop()
    assert type(loop).__name__ == "FreshBootLoop"
    assert 0 <= loop.time() < 3600  # no suite runs for an hour
    before = loop.time()
    await asyncio.sleep(0.01)  # timers run on the same clock
    assert loop.time() >= before + 0.01


def frozen_at_boot() -> float:
    """A clock that reads 0.0: the instant of a boot, forever."""
    return 0.0


def booted_now() -> Callable[[], float]:
    """A monotonic clock that starts at 0 now, as a machine's does at boot."""
    boot = time.monotonic()
    return lambda: time.monotonic() - boot


async def test_a_projector_on_a_clock_at_zero_writes_its_first_checkpoint_at_once(
    events_js: JetStream,
) -> None:
    """Its last write began as 0.0: on a clock starting at 0 the first fold
    waited a whole flush interval (here an hour) before it was stored."""
    await publish(events_js, [started("r")])

    async def checkpointed() -> bool:
        with contextlib.suppress(NatsNotFoundError):
            return (await stored(events_js)).last_seq == 1
        return False

    async with Projector(events_js, flush_interval=3600.0, clock=booted_now()):
        await until(checkpointed, "the first fold is stored", within=10)
    assert (await stored(events_js)).backends["b1"].in_flight == 1


async def test_a_lease_on_a_clock_at_zero_is_invalid_until_granted_and_valid_after(
    events_js: JetStream,
) -> None:
    """Not held is never valid, whatever the clock reads ("valid until -inf")."""
    lease = Lease(events_js, "binder", holder="a", ttl=2.0, clock=frozen_at_boot)
    assert not lease.valid()
    assert await lease.try_acquire()
    assert lease.valid()
    await lease.release()
    assert not lease.valid()
