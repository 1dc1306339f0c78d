"""bench/http_clients.py (bench/README.md, *The adapters' HTTP client*): its command runs
on both event loops, every client's every answer is checked and right (no errors), and
its JSON is written. Its rates are not checked here (speed belongs to bench/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_the_http_clients_bench_runs_every_cell_without_errors(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    command = [sys.executable, str(REPO / "bench" / "http_clients.py"), "--quick"]
    command += ["--levels", "1,4", "--seconds", "0.2", "--out", str(tmp_path)]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "adapter_aiohttp CPU / adapter_httpcore CPU" in done.stdout
    report = json.loads((tmp_path / "http-clients-latest.json").read_text())
    assert report["loops"] == ["asyncio", "uvloop"]
    for loop, cells in report["rounds_detail"].items():
        for key, cell in cells[0].items():
            assert cell["errors"] == 0, (loop, key, cell["error_samples"])
            assert cell["requests"] > 0, (loop, key)
    assert len(report["results"]["uvloop"]) == 2 * 2 * 3  # modes x levels x clients
