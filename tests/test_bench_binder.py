"""bench/binder.py (docs/scaling.md, ``make bench-binder``): the binder's ceiling bench
runs, in both modes, and binds every request it published exactly once (none left
waiting). Its rate is not checked here (speed belongs to the bench); this keeps the
command working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mode",
    [[], ["--takeover"], ["--groups", "2", "--routers", "2"]],
    ids=["steady", "takeover", "two-groups"],
)
def test_the_binder_bench_binds_every_request_once(tmp_path: Path, mode: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [
            sys.executable, str(REPO / "bench" / "binder.py"), "--requests", "400",
            "--backends", "2", "--slots", "8", "--baseline-seconds", "0.3",
            "--out", str(tmp_path), *mode,
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=230, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "binder-latest.json").read_text())
    assert (report["bound"], report["left_waiting"]) == (400, 0)
    assert report["binds_per_s"] > 0
    assert report["mode"] == ("takeover" if "--takeover" in mode else "steady")
    assert report["groups"] == (2 if "--groups" in mode else 1)
