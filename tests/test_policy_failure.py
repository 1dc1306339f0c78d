"""The worker's failure policy (renqueue.policy.after_failure): tables, then the worker using it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from renqueue import Client, RequestFailedError, Services, parse_config
from renqueue.broker import EventLog
from renqueue.errors import (
    BadRequestError,
    ConfigError,
    FatalBackendError,
    RateLimitedError,
    RetryableBackendError,
)
from renqueue.mock import MockBackend, MockSettings
from renqueue.policy import Fail, FailurePolicy, RequeueElsewhere, Retry, after_failure, backoff
from renqueue.schema import Retrying

POLICY = FailurePolicy(budget=5, retry_delay=1.0, max_retry_delay=30.0)


def fixed(value: float) -> Callable[[], float]:
    return lambda: value


def unavailable() -> RetryableBackendError:
    return RetryableBackendError("HTTP 503", backend="b", status=503)


def limited(retry_after: float | None) -> RateLimitedError:
    return RateLimitedError("HTTP 429", backend="b", retry_after=retry_after)


def spent(retry_after: float | None = None, until: float | None = None) -> RateLimitedError:
    """A 429 that says the quota is spent (until ``until``, if it says)."""
    return RateLimitedError(
        "HTTP 429", backend="b", retry_after=retry_after,
        quota_exhausted=True, quota_exhausted_until=until,
    )  # fmt: skip


SPENT = "b: HTTP 429 (quota exhausted: back to routing)"


@pytest.mark.parametrize(
    ("error", "failed_runs", "jitter", "expected"),
    [
        pytest.param(
            unavailable(), 0, 0.5,
            Retry(delay=0.75, error_type="backend_unavailable", reason="b: HTTP 503"),
            id="first failure: half the first step plus jitter",
        ),
        pytest.param(
            unavailable(), 3, 0.0,
            Retry(delay=4.0, error_type="backend_unavailable", reason="b: HTTP 503"),
            id="fourth failure: the step doubled three times, jitter at its floor",
        ),
        pytest.param(
            unavailable(), 4, 0.5,
            Fail(error_type="backend_unavailable", reason="b: HTTP 503 (retries exhausted)"),
            id="the budget's last run fails the request",
        ),
        pytest.param(
            limited(42.0), 0, 0.5,
            Retry(delay=42.0, error_type="rate_limited", reason="b: HTTP 429"),
            id="a provider's retry-after wins, even above the cap",
        ),
        pytest.param(
            limited(0.25), 3, 0.5,
            Retry(delay=0.25, error_type="rate_limited", reason="b: HTTP 429"),
            id="a provider's retry-after wins, even below the backoff",
        ),
        pytest.param(
            limited(None), 1, 1.0,
            Retry(delay=2.0, error_type="rate_limited", reason="b: HTTP 429"),
            id="a 429 without retry-after backs off",
        ),
        pytest.param(
            limited(0.0), 0, 0.0,
            Retry(delay=0.5, error_type="rate_limited", reason="b: HTTP 429"),
            id="a zero retry-after says nothing: backoff",
        ),
        pytest.param(
            limited(math.inf), 0, 0.0,
            Retry(delay=0.5, error_type="rate_limited", reason="b: HTTP 429"),
            id="a non-finite retry-after is no delay: backoff",
        ),
        pytest.param(
            limited(7.0), 4, 0.5,
            Fail(error_type="rate_limited", reason="b: HTTP 429 (retries exhausted)"),
            id="rate limited on the budget's last run fails, retries exhausted",
        ),
        pytest.param(
            spent(until=1_750_000_000.0), 0, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=None),
            id="a spent quota with a known reset goes back to routing; the reset holds the backend",
        ),
        pytest.param(
            spent(retry_after=3600.0, until=1_750_000_000.0), 0, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=None),
            id="a spent quota goes elsewhere even with a retry-after: no waiting here for it",
        ),
        pytest.param(
            spent(), 0, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=600.0),
            id="insufficient_quota, no reset known: elsewhere, the backend held quota_hold",
        ),
        pytest.param(
            spent(retry_after=5.0), 0, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=600.0),
            id="no reset known: a short retry-after does not shorten the hold",
        ),
        pytest.param(
            spent(retry_after=7200.0), 0, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=7200.0),
            id="no reset known: a retry-after longer than the hold is honoured",
        ),
        pytest.param(
            spent(until=1_750_000_000.0), 4, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=None),
            id="on the budget's last run a spent quota still goes elsewhere: not a failure",
        ),
        pytest.param(
            spent(), 99, 0.5,
            RequeueElsewhere(error_type="rate_limited", reason=SPENT, hold=600.0),
            id="past the budget too: a requeue spends no retry",
        ),
        pytest.param(
            FatalBackendError("HTTP 401", backend="b", status=401), 0, 0.5,
            Fail(error_type="backend_fatal", reason="b: HTTP 401"),
            id="a fatal error fails at once",
        ),
        pytest.param(
            BadRequestError("HTTP 400", backend="b", status=400), 0, 0.5,
            Fail(error_type="backend_bad_request", reason="b: HTTP 400"),
            id="a bad request fails at once",
        ),
        pytest.param(
            RuntimeError("bug"), 1, 0.0,
            Retry(delay=1.0, error_type="internal", reason="worker error: RuntimeError"),
            id="a worker error is retried with the same backoff",
        ),
        pytest.param(
            RuntimeError("bug"), 4, 0.0,
            Fail(
                error_type="internal",
                reason="worker error on the last allowed run: RuntimeError",
            ),
            id="a worker error on the budget's last run fails",
        ),
    ],
)  # fmt: skip
def test_a_failed_run_is_retried_or_failed_as_the_rules_say(
    error: BaseException, failed_runs: int, jitter: float, expected: object
) -> None:
    got = after_failure(error, failed_runs=failed_runs, policy=POLICY, random=fixed(jitter))
    assert got == expected


def test_a_budget_of_one_run_fails_the_first_failure() -> None:
    policy = FailurePolicy(budget=1, retry_delay=1.0, max_retry_delay=30.0)
    got = after_failure(unavailable(), failed_runs=0, policy=policy, random=fixed(0.5))
    assert got == Fail(error_type="backend_unavailable", reason="b: HTTP 503 (retries exhausted)")


def test_a_long_error_message_is_cut_before_the_suffix() -> None:
    error = RetryableBackendError("x" * 5000, backend="b")
    got = after_failure(error, failed_runs=4, policy=POLICY, random=fixed(0.5))
    assert isinstance(got, Fail)
    assert got.reason == ("b: " + "x" * 5000)[:1000] + " (retries exhausted)"


@pytest.mark.parametrize("step", [1, 2, 3, 5, 6, 7, 20, 64, 10_000])
@pytest.mark.parametrize("jitter", [0.0, 0.3, 0.999999])
def test_backoff_doubles_is_capped_and_jittered_within_its_step(step: int, jitter: float) -> None:
    ceiling = min(30.0, 2.0 ** min(step - 1, 64))
    delay = backoff(step, POLICY, fixed(jitter))
    assert delay == pytest.approx(ceiling / 2 + jitter * ceiling / 2)
    assert ceiling / 2 <= delay < ceiling
    assert delay < 30.0


def test_backoff_spreads_runs_that_failed_together() -> None:
    draws = iter([0.0, 0.25, 0.5, 0.75])
    delays = [backoff(3, POLICY, lambda: next(draws)) for _ in range(4)]
    assert delays == [2.0, 2.5, 3.0, 3.5]


def test_the_config_gives_the_policy_and_refuses_a_cap_below_the_first_step() -> None:
    config = parse_config({"worker": {"max_deliver": 3, "retry_delay": "200ms"}})
    assert config.worker.failure_policy() == FailurePolicy(
        budget=3, retry_delay=0.2, max_retry_delay=30.0, quota_hold=600.0
    )
    held = parse_config({"worker": {"quota_hold": "1h"}})
    assert held.worker.failure_policy().quota_hold == 3600.0
    with pytest.raises(ConfigError, match="max_retry_delay") as info:
        parse_config({"worker": {"retry_delay": "2s", "max_retry_delay": "1s"}})
    assert info.value.path == "$.worker"


async def test_the_worker_retries_with_the_capped_backoff_then_fails(tmp_path: Path) -> None:
    """Wired: a backend that always fails gets the budget's runs, each retry
    delayed by the capped, jittered backoff (uncapped, the third and fourth
    would wait 200 and 400 ms), then the request fails for good."""
    async with MockBackend(MockSettings(failure_rate=1.0)) as broken:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b": {"base_url": broken.url, "model": "m"}},
                # No fallback: every run on the bound backend, as the budget allows.
                "routes": {"chat": {"backends": ["b"], "fallback": {"on": []}}},
                "worker": {"max_deliver": 5, "retry_delay": "50ms", "max_retry_delay": "100ms"},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            handle = await client.submit("x", route="chat")
            with pytest.raises(RequestFailedError) as info:
                await handle.result(timeout=20)
            events = await EventLog(client.js).history("t", handle.id)
    delays = [event.retry_after for event in events if isinstance(event, Retrying)]
    assert len(delays) == 4
    assert all(delay is not None and delay <= 0.1 for delay in delays)
    assert all(delay is not None and delay >= 0.05 for delay in delays[1:])
    assert info.value.error_type == "backend_unavailable"
    assert broken.stats().requests == 5
