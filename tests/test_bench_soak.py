"""bench/soak.py (bench/README.md, *Soak*): its separate-process deployment starts,
provisions its stores on the harness's own nats-server, runs a short mixed workload
with a flapping backend, and audits it: nothing lost or duplicated, no service
restarted. Growth and rates are not checked here (they belong to ``make soak``); this
keeps the command working (it could not provision once the stores were bounded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_a_short_soak_runs_and_loses_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [
            sys.executable, str(REPO / "bench" / "soak.py"),
            "--minutes", "0.2", "--rate", "5", "--warmup", "4", "--sample-every", "4",
            "--flap-every", "6", "--flap-down", "2", "--tail", "90", "--out", str(tmp_path),
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=230, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = [p for p in tmp_path.glob("soak-*.json") if p.name != "soak-latest.json"]
    report = json.loads(result.read_text())
    assert (report["lost"], report["duplicated"], report["service_restarts"]) == (0, 0, 0)
    assert sum(report["outcomes"].values()) > 0
    assert "unresolved" not in report["outcomes"]
    assert "LOST 0  DUPLICATED 0" in done.stdout
