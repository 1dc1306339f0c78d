"""What a run of a workload came to: cost, deadline attainment per level,
share per backend, and how requests ended, for the recorded run and each
simulation side by side (``renqueue replay --what-if``).

- **cost**: US dollars of the completed calls (a request that shared another's
  call costs nothing of its own);
- **attainment** of a level: the share of the requests submitted at it that
  completed in time (before their deadline, or at all when they had none);
- **share** of a backend: the share of completed requests it completed.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Final

from msgspec import Struct

from ._outcomes import Outcome
from ._trace import Trace

__all__ = ["ENDINGS", "Column", "Level", "Summary", "recorded_outcomes", "render", "summarize"]

#: How a request may end, in the order the report lists them.
ENDINGS: Final = ("completed", "expired", "failed", "cancelled", "rejected", "unfinished")


class Level(Struct, frozen=True, kw_only=True):
    """One priority level's requests: submitted, with a deadline, completed in time."""

    submitted: int = 0
    with_deadline: int = 0
    in_time: int = 0

    @property
    def attainment(self) -> float:
        return self.in_time / self.submitted if self.submitted else 0.0


class Summary(Struct, frozen=True, kw_only=True):
    """One run of the workload, summed up (module docstring)."""

    requests: int
    cost: float
    ended: dict[str, int]
    levels: dict[str, Level]
    #: Completed requests per backend.
    share: dict[str, int]

    def share_of(self, backend: str) -> float:
        done = sum(self.share.values())
        return self.share.get(backend, 0) / done if done else 0.0


def summarize(outcomes: Iterable[Outcome], levels: Sequence[str] = ()) -> Summary:
    """The summary of ``outcomes``; ``levels`` name the levels to list first
    (the config's, most urgent first), any other level follows."""
    cost = 0.0
    ended: dict[str, int] = dict.fromkeys(ENDINGS, 0)
    by_level: dict[str, list[int]] = {level: [0, 0, 0] for level in levels}
    share: dict[str, int] = {}
    count = 0
    for outcome in outcomes:
        count += 1
        cost += outcome.cost
        ended[outcome.kind] = ended.get(outcome.kind, 0) + 1
        level = by_level.setdefault(outcome.level, [0, 0, 0])
        level[0] += 1
        level[1] += outcome.deadline is not None
        level[2] += outcome.in_time
        if outcome.kind == "completed" and outcome.backend is not None:
            share[outcome.backend] = share.get(outcome.backend, 0) + 1
    return Summary(
        requests=count,
        cost=cost,
        ended=ended,
        levels={
            name: Level(submitted=n, with_deadline=d, in_time=ok)
            for name, (n, d, ok) in by_level.items()
        },
        share=dict(sorted(share.items())),
    )


def recorded_outcomes(trace: Trace) -> tuple[Outcome, ...]:
    """What really became of each request of ``trace``, as :class:`Outcome` s."""
    return tuple(
        Outcome(
            request_id=arrival.request.id,
            tenant=arrival.request.tenant,
            level=arrival.request.priority,
            deadline=arrival.request.deadline,
            kind=arrival.recorded.kind,
            at=arrival.recorded.at,
            backend=arrival.recorded.backend,
            cost=arrival.recorded.cost,
        )
        for arrival in trace.arrivals
    )


class Column(Struct, frozen=True, kw_only=True):
    """One column of the report: its title and its run's summary."""

    title: str
    summary: Summary
    #: Notes printed under the table (an assumed model, a simulation stopped early).
    notes: tuple[str, ...] = ()


def _clock(at: float) -> str:
    when = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def _percent(part: float) -> str:
    return f"{100 * part:.1f} %"


def render(trace: Trace, columns: Sequence[Column], *, seed: int) -> list[str]:
    """The report's lines: a header, one row per measure, a column per run
    (each simulation's cost also as a change from the first column's), then notes."""
    first = columns[0].summary
    lines = [
        f"What-if replay of {first.requests} request{'s' if first.requests != 1 else ''}"
        f" submitted {_clock(trace.since)} .. {_clock(trace.until)}"
        f" ({trace.events} events read, {trace.dropped} dropped; seed {seed})",
        "",
    ]
    width = 18
    rows: list[tuple[str, list[str]]] = []

    def cost(summary: Summary) -> str:
        text = f"${summary.cost:.6f}"
        if summary is first or first.cost <= 0:
            return text
        return f"{text} ({100 * (summary.cost - first.cost) / first.cost:+.1f} %)"

    rows.append(("cost", [cost(column.summary) for column in columns]))
    for kind in ENDINGS:
        counts = [column.summary.ended.get(kind, 0) for column in columns]
        if kind in ("completed", "expired", "failed") or any(counts):
            rows.append((kind, [str(count) for count in counts]))
    rows.append(("in time, by level", ["" for _ in columns]))
    names = list(
        dict.fromkeys(
            name
            for column in columns
            for name, level in column.summary.levels.items()
            if level.submitted
        )
    )
    for name in names:
        cells = []
        for column in columns:
            level = column.summary.levels.get(name, Level())
            cells.append(
                f"{_percent(level.attainment)} of {level.submitted}" if level.submitted else "-"
            )
        rows.append((f"  {name}", cells))
    rows.append(("share, by backend", ["" for _ in columns]))
    backends = sorted({name for column in columns for name in column.summary.share})
    for name in backends:
        rows.append((f"  {name}", [_percent(column.summary.share_of(name)) for column in columns]))
    widths = [
        max(len(column.title), *(len(cells[index]) for _, cells in rows)) + 2
        for index, column in enumerate(columns)
    ]
    label = max(width, *(len(name) for name, _ in rows)) + 2
    lines.append(
        " " * label + "".join(f"{c.title:>{w}}" for c, w in zip(columns, widths, strict=True))
    )
    for name, cells in rows:
        cells_text = "".join(f"{cell:>{w}}" for cell, w in zip(cells, widths, strict=True))
        lines.append(f"{name:<{label}}{cells_text}".rstrip())
    notes = [note for column in columns for note in column.notes]
    if notes:
        lines.append("")
        lines.extend(notes)
    return lines
