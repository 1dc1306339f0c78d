"""``make fuzz``'s short mode (bench/fuzz.py --short): hostile NATS messages on every
subject a tenant may publish to, hostile HTTP requests to the gateway and malformed
config files, beside a good workload, on a real nats-server (nats/auth.conf), the
services as a ``renqueue up`` process and the mock backend. Its verdicts must hold:
nothing crashes, no good request is lost or fails, every hostile message gets a typed
rejection or is counted where it is dropped, and every bad config is a ConfigError.

The latencies it prints are not checked here (speed belongs to bench/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_the_short_fuzz_run_crashes_nothing_loses_nothing_and_accounts_for_every_input(
    tmp_path: Path,
) -> None:
    out = tmp_path / "fuzz.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "fuzz.py"),
            "--short",
            "--no-save",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdicts"] == {
        "service_crashes": 0,
        "good_lost_or_failed": 0,
        "hostile_nats_unaccounted": 0,
        "hostile_http_unanswered_or_5xx": 0,
        "configs_untyped": 0,
    }, done.stdout[-3000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Everything was sent, and the run saw each kind of outcome it accounts for.
    assert report["counts"] == {"nats": 250, "http": 250, "configs": 100}
    nats = report["nats"]
    assert nats["stored_and_rejected"] > 0
    assert nats["dropped_cancels"] > 0
    assert (
        report["metrics"]["renqueue_misdirected_messages_total"]["receiver=cancels"]
        >= (nats["dropped_cancels"])
    )
    assert nats["left_in_requests_stream"] == 0
    assert report["latency"]["baseline"]["completed"] > 0
    assert report["latency"]["fuzz"]["completed"] > 0
    assert report["configs"]["outcomes"].get("config_error", 0) > 0
