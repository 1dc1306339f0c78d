"""bench/rejections.py (bench/README.md, *Rejections alone*): its command runs, and every
malformed request of the backlog it makes gets its dead letter and is counted in
``renqueue_rejected_total``, of both kinds. Its rate is not checked here (speed
belongs to bench/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["noheader", "junk"])
def test_the_rejections_bench_rejects_its_whole_backlog(kind: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "rejections.py"), "--count", "40", "--kind", kind],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"rejections ({kind}, 40 over 1 tenant(s))" in done.stdout
    assert "40 dead letters, renqueue_rejected_total 40" in done.stdout
