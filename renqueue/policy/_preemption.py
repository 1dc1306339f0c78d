"""Who may preempt whom: plain functions of levels and runs.

The protocol that carries these decisions out (ask, offer, confirm, over core
NATS) is :mod:`renqueue.schema._offers`; the router asks when the round planner
(:func:`renqueue.policy.plan`) says so, and the worker holding the runs
answers with :func:`choose_victim`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._aging import LevelPolicy


def may_preempt(rank: int, policies: Sequence[LevelPolicy]) -> bool:
    """Whether a waiting request at ``rank`` may take a running one's slot."""
    return policies[rank].preempts


def preempting_rank(rank: int, parent: tuple[int, float] | None) -> int:
    """The rank a waiting request preempts at: the level it was submitted at,
    or its parent's if that is more urgent (inheritance), never one it aged
    to: aged requests preempting each other under overload would only churn.
    ``parent`` is the parent's (rank, submitted_at)."""
    return rank if parent is None else min(rank, parent[0])


def choose_victim(
    runs: Mapping[str, tuple[int, float]], rank: int, policies: Sequence[LevelPolicy]
) -> str | None:
    """Which run gives its slot to a request at effective ``rank``.

    ``runs`` maps request id to (effective rank it runs at, start time). Only
    preemptible runs strictly less urgent than ``rank`` qualify; the least
    urgent goes first, and among those the most recently started (the least
    work thrown away). ``None``: nothing may be preempted.
    """
    eligible = [
        (run_rank, started, request_id)
        for request_id, (run_rank, started) in runs.items()
        if run_rank > rank and policies[run_rank].preemptible
    ]
    return max(eligible)[2] if eligible else None


def least_urgent_victim(policies: Sequence[LevelPolicy]) -> int | None:
    """The least urgent rank a run can be preempted at (``None``: no level is
    preemptible). An offer of a run at this rank on the first candidate backend
    in cascade order is the best offer any worker can make but for which of
    such runs: the router may take it without waiting for others."""
    ranks = [policy.rank for policy in policies if policy.preemptible]
    return max(ranks) if ranks else None
