"""The binder's ledger: its own reservations counted until the projection folds them."""

from __future__ import annotations

from renqueue import parse_config
from renqueue.coordination import LiveState
from renqueue.policy import Cost, Quota, check
from renqueue.services.router._ledger import Ledger

CONFIG = parse_config(
    {
        "backends": {
            "free": {
                "base_url": "http://127.0.0.1:9",
                "model": "m",
                "limits": {"requests": ["10/min"]},
            },
            "other": {
                "base_url": "http://127.0.0.1:9",
                "model": "m",
                "limits": {"requests": ["10/min"]},
            },
            "open": {"base_url": "http://127.0.0.1:9", "model": "m"},
        },
        "routes": {"chat": {"backends": ["free", "other", "open"]}},
    }
)


def used(ledger: Ledger, backend: str, state: LiveState | None = None) -> int:
    quota, _ = ledger.quota(backend, state, now=100.0)
    assert quota is not None
    return sum(slot.requests for slot in quota.spend.slots)


def folded_upto(seq: int) -> LiveState:
    return LiveState(last_seq=seq)


def test_a_reservation_counts_until_the_projection_folds_its_decision() -> None:
    ledger = Ledger(CONFIG)
    first = ledger.reserving("free", Cost(requests=1), 100.0)
    second = ledger.reserving("free", Cost(requests=1), 100.5)
    first.logged("free", 7)
    second.logged("free", 9)
    assert used(ledger, "free") == 2
    ledger.prune(folded_upto(8))
    assert len(ledger) == 1
    ledger.prune(folded_upto(9))
    assert len(ledger) == 0


def test_an_unlogged_reservation_survives_any_prune_and_a_dropped_one_counts_nothing() -> None:
    ledger = Ledger(CONFIG)
    waiting = ledger.reserving("free", Cost(requests=1), 100.0)
    gone = ledger.reserving("free", Cost(requests=1), 100.0)
    gone.dropped()
    ledger.prune(folded_upto(10**9))
    assert len(ledger) == 1
    assert used(ledger, "free") == 1
    waiting.logged("free", 5)
    ledger.prune(folded_upto(4))
    assert len(ledger) == 1


def test_a_decision_logged_for_another_backend_moves_its_reservation() -> None:
    ledger = Ledger(CONFIG)
    reserved = ledger.reserving("free", Cost(requests=1), 100.0)
    reserved.logged("other", 3)
    assert used(ledger, "other") == 1
    quota, _ = ledger.quota("free", None, now=100.0)
    assert quota is not None
    assert not quota.spend.slots


def test_prune_forgets_out_of_order_sequences_once_each() -> None:
    ledger = Ledger(CONFIG)
    reservations = [ledger.reserving("free", Cost(requests=1), 100.0) for _ in range(5)]
    for reserved, seq in zip(reservations, [50, 10, 40, 20, 30], strict=True):
        reserved.logged("free", seq)
    ledger.prune(folded_upto(25))
    assert len(ledger) == 3
    ledger.prune(folded_upto(25))
    assert len(ledger) == 3
    ledger.prune(folded_upto(50))
    assert len(ledger) == 0


def test_a_pause_judges_a_backend_out_until_it_passes_whatever_the_projection_says() -> None:
    """A backend whose provider said its quota is spent (read by the binder
    from a put-back request's ``retrying`` event) is out until then, even one
    with no limits at all (otherwise not judged) and with a projection that
    says nothing of it; once the time passes the pause is dropped."""
    ledger = Ledger(CONFIG)
    assert ledger.quota("open", None, now=100.0) == (None, ())
    ledger.pause("open", 160.0)
    ledger.pause("open", 130.0)  # an earlier end never shortens it
    quota, limits = ledger.quota("open", folded_upto(10**9), now=100.0)
    assert quota is not None
    assert quota.exhausted_until == 160.0
    verdict = check(quota, limits, Cost(requests=1), 100.0)
    assert not verdict.ok
    assert verdict.until == 160.0
    assert "quota exhausted" in verdict.reason
    assert ledger.quota("open", None, now=160.0) == (None, ())
    assert ledger.paused_until("open", 100.0) is None  # dropped once passed


def test_a_pause_holds_on_top_of_the_projections_quota() -> None:
    ledger = Ledger(CONFIG)
    ledger.pause("free", 500.0)
    quota, _ = ledger.quota("free", None, now=100.0)
    assert quota is not None
    assert quota.exhausted_until == 500.0
    assert ledger.quota("free", None, now=500.0)[0] == Quota()
