"""Operating A/B splits: what ``renqueue ab status | promote | rollback | resume`` does.

:func:`read_splits` reads each split's state and per-arm figures from the
projector's checkpoint (the key ``projection`` in ``rq-state``) into
:class:`SplitReport` s, beside what the config says of the split (arms,
weights, control, thresholds); :func:`render_splits` turns them into lines of
text, with no I/O of its own. Figures are over the split's rollback
``window`` (5 minutes when it has none) and since the split began; latencies
are from each request's submission (p50 and p95, from the fold's histograms:
within 9 %).

:func:`move_split` logs an operator's move of a split as an ``ab`` event
(``rq.evt._system.<route>.ab``, ``operator`` naming who, ``reason`` why), the
same kind of event the binder logs for an automatic rollback; every router
follows it once the projection shows it. It is idempotent: a split already
where it is asked to go is left alone and nothing is logged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final, Literal

from msgspec import Struct

from ..broker import EventLog, JetStream
from ..config import Config
from ..errors import RenQueueError
from ..policy import ArmStats, SplitPolicy, Tally, moved_to, percentile, windowed
from ..schema import STATE_BUCKET, SplitChanged, split_changed
from ..state import ProjectionState, SplitState
from ..text import clock, printable
from ._verify import read_checkpoint

__all__ = [
    "ArmFigures",
    "ArmReport",
    "Move",
    "SplitReport",
    "move_split",
    "planned_move",
    "read_splits",
    "render_splits",
    "splits_of",
]

#: The window figures are reported over for a split with no rollback rules.
_DEFAULT_WINDOW: Final = 300.0
#: How long a move waits for the projection to show it.
_SHOWN_WITHIN: Final = 5.0

Move = Literal["promote", "rollback", "resume"]


class ArmFigures(Struct, frozen=True, kw_only=True):
    """What an arm's requests did over some stretch (see :class:`~renqueue.policy.Tally`).

    ``error_rate``: failed and expired over everything that ended (``None``
    when nothing did); latencies in seconds from submission (``None`` when
    nothing completed); ``cost`` in US dollars.
    """

    requests: int
    completed: int
    failed: int
    expired: int
    error_rate: float | None
    latency_p50: float | None
    latency_p95: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    cost: float


class ArmReport(Struct, frozen=True, kw_only=True):
    """One arm: its configured weight (``None``: not an arm in this config),
    whether it is the control, and its figures in the window and in total."""

    arm: str
    weight: float | None
    control: bool
    window: ArmFigures
    total: ArmFigures


class SplitReport(Struct, frozen=True, kw_only=True):
    """One split: where its traffic goes (``state``, and ``arm`` unless live),
    since when, why, by whom, and each arm's figures."""

    route: str
    #: The config has this split (else only the log knows it).
    configured: bool
    state: str
    #: Where all of its traffic goes now (empty while live).
    arm: str
    since: float
    reason: str
    by: str
    control: str
    key: str
    #: Seconds the window figures cover.
    window: float
    arms: tuple[ArmReport, ...]
    #: Something the operator should know (a logged arm no longer configured).
    note: str = ""


def figures(seen: Tally) -> ArmFigures:
    """A :class:`~renqueue.policy.Tally` as numbers a report shows."""
    return ArmFigures(
        requests=seen.requests,
        completed=seen.completed,
        failed=seen.failed,
        expired=seen.expired,
        error_rate=None if seen.ended == 0 else seen.errors / seen.ended,
        latency_p50=percentile(seen.latency, 50),
        latency_p95=percentile(seen.latency, 95),
        ttft_p50=percentile(seen.ttft, 50),
        ttft_p95=percentile(seen.ttft, 95),
        cost=seen.cost,
    )


def split_report(
    route: str, split: SplitPolicy | None, folded: SplitState | None, now: float
) -> SplitReport:
    """One split's report at ``now`` from its policy (``None``: not configured)
    and its folded state (``None``: the log has nothing of it yet)."""
    folded = folded or SplitState()
    window = (
        split.rollback.window if split is not None and split.rollback is not None else None
    ) or _DEFAULT_WINDOW
    weights = dict(split.arms) if split is not None else {}
    names = [*weights, *sorted(set(folded.arms) - set(weights))]
    arms = tuple(
        ArmReport(
            arm=name,
            weight=weights.get(name),
            control=split is not None and name == split.control,
            window=figures(windowed(folded.arms.get(name, _NO_STATS), now, window)),
            total=figures(folded.arms.get(name, _NO_STATS).total),
        )
        for name in names
    )
    note = ""
    arm = folded.arm
    if split is not None and folded.state != "live":
        target = moved_to(split, folded)
        if target != folded.arm:
            note = (
                f"{folded.arm} is no longer an arm of this split: its traffic goes to the "
                f"control {target} (resume it with `renqueue ab resume {route}`)"
            )
            arm = target or ""
    return SplitReport(
        route=route,
        configured=split is not None,
        state=folded.state,
        arm=arm,
        since=folded.since,
        reason=folded.reason,
        by=folded.by,
        control="" if split is None else split.control,
        key="" if split is None else split.key,
        window=window,
        arms=arms,
        note=note,
    )


_NO_STATS: Final = ArmStats()


def _policies(config: Config) -> dict[str, SplitPolicy]:
    return {name: route.ab.policy(name) for name, route in config.routes.items() if route.ab}


async def _checkpoint(js: JetStream) -> ProjectionState | None:
    read = await read_checkpoint(await js.key_value(STATE_BUCKET))
    return None if read is None else read[0]


async def read_splits(
    js: JetStream, config: Config, route: str | None = None, *, now: float | None = None
) -> list[SplitReport]:
    """Every split the config or the log knows (or only ``route``'s), at ``now``
    (default: ``time.time()``). Raises :class:`RenQueueError` for a ``route``
    that neither knows, or a checkpoint that does not decode."""
    at = time.time() if now is None else now
    reports = splits_of(config, await _checkpoint(js), at)
    if route is None:
        return reports
    chosen = [report for report in reports if report.route == route]
    if not chosen:
        raise RenQueueError(f"route {route!r} has no A/B split (in the config or the log)")
    return chosen


def splits_of(config: Config, state: ProjectionState | None, now: float) -> list[SplitReport]:
    """Every split the config or a checkpoint (``None``: none stored) knows, at ``now``. Pure."""
    folded = {} if state is None else state.splits.routes
    policies = _policies(config)
    names = [*policies, *sorted(set(folded) - set(policies))]
    return [split_report(name, policies.get(name), folded.get(name), now) for name in names]


def planned_move(config: Config, route: str, move: Move, arm: str | None = None) -> tuple[str, str]:
    """The state and arm ``move`` takes ``route``'s split to, by ``config``.

    Raises :class:`RenQueueError` for a route with no split in ``config`` or
    an arm (``promote``) that is not one of its arms.
    """
    policy = _policies(config).get(route)
    if policy is None:
        raise RenQueueError(f"route {route!r} has no A/B split in this config")
    if move == "promote":
        if arm is None or arm not in policy.names:
            raise RenQueueError(
                f"{arm!r} is not an arm of {route!r}'s split (arms: {', '.join(policy.names)})"
            )
        return "promoted", arm
    if move == "rollback":
        return "rolled_back", policy.control
    return "live", ""


async def move_split(
    js: JetStream,
    config: Config,
    route: str,
    move: Move,
    *,
    arm: str | None = None,
    operator: str,
    reason: str = "",
    now: float | None = None,
) -> tuple[SplitChanged | None, SplitState | None]:
    """Log an operator's ``move`` of ``route``'s split (``promote`` needs
    ``arm``): the event logged (``None``: the split is there already, nothing
    logged) and the split as the projection shows it afterwards (``None``: it
    did not show the move within 5 s; no projector running?).

    Raises :class:`RenQueueError` for a route with no split in ``config`` or
    an arm that is not one of its arms.
    """
    state, target = planned_move(config, route, move, arm)
    checkpoint = await _checkpoint(js)
    current = None if checkpoint is None else checkpoint.splits.routes.get(route)
    previous = "live" if current is None else current.state
    if previous == state and (current is None or current.arm == target):
        return None, current
    at = time.time() if now is None else now
    event = split_changed(
        route,
        at=at,
        state=state,
        arm=target,
        previous=previous,
        reason=reason or f"operator {move}",
        operator=operator,
    )
    await EventLog(js).append(event)
    return event, await _shown(js, route, at)


async def _shown(js: JetStream, route: str, at: float) -> SplitState | None:
    """The split once the checkpoint shows a move at ``at`` or later (``None``
    if it does not within :data:`_SHOWN_WITHIN` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _SHOWN_WITHIN
    while loop.time() < deadline:
        state = await _checkpoint(js)
        split = None if state is None else state.splits.routes.get(route)
        if split is not None and split.since >= at:
            return split
        await asyncio.sleep(0.1)
    return None


# -------------------------------------------------------------------- render


def render_splits(reports: list[SplitReport]) -> list[str]:
    """The lines ``renqueue ab status`` prints."""
    if not reports:
        return ["no A/B splits: no route has an [routes.<name>.ab] section, and the log has none"]
    lines: list[str] = []
    for report in reports:
        if lines:
            lines.append("")
        lines.extend(_render_split(report))
    return lines


def _render_split(report: SplitReport) -> list[str]:
    route = printable(report.route)
    if report.state == "live":
        where = "live: traffic split by weight"
    elif report.state == "rolled_back":
        where = f"ROLLED BACK: all traffic to {printable(report.arm)}"
    else:
        where = f"PROMOTED: all traffic to {printable(report.arm)}"
    head = f"A/B split {route}: {where}"
    if report.since:
        head += f" since {clock(report.since)}"
    lines = [head]
    if report.configured:
        lines.append(f"  control {printable(report.control)}, sticky by {printable(report.key)}")
    else:
        lines.append("  not in this config (only the log knows it)")
    if report.reason or report.by:
        lines.append(f"  {printable(report.reason)} (by {printable(report.by or '?')})")
    if report.note:
        lines.append(f"  note: {printable(report.note)}")
    width = max([12, *(len(printable(arm.arm)) + 10 for arm in report.arms)])
    header = (
        f"  {'arm':<{width}} {'weight':>6} {'requests':>8} {'done':>6} {'failed':>6}"
        f" {'expired':>7} {'errors':>6} {'p50 s':>7} {'p95 s':>7} {'ttft50':>7}"
        f" {'ttft95':>7} {'cost $':>10}"
    )
    for title, total in ((f"in the last {report.window:g} s", False), ("in total", True)):
        lines += [f"  {title}:", header]
        for arm in report.arms:
            name = printable(arm.arm) + (" (control)" if arm.control else "")
            seen = arm.total if total else arm.window
            weight = "-" if arm.weight is None else f"{arm.weight:g}"
            lines.append(
                f"  {name:<{width}} {weight:>6} {seen.requests:>8} {seen.completed:>6}"
                f" {seen.failed:>6} {seen.expired:>7} {_rate(seen.error_rate):>6}"
                f" {_seconds(seen.latency_p50):>7} {_seconds(seen.latency_p95):>7}"
                f" {_seconds(seen.ttft_p50):>7} {_seconds(seen.ttft_p95):>7}"
                f" {seen.cost:>10.6f}"
            )
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"
