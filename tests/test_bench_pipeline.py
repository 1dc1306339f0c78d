"""``bench/pipeline.py`` in its one-process mode (bench/README.md; ``make bench``), at its
smallest: the pipeline's requests complete, and the floor (``bench/_floor.py``: the same
five stored messages a request with no Ren-Queue logic, its router and workers tasks of
the bench process) is measured beside it in both HTTP variants and compared with it.
Rates are not checked here (speed belongs to the bench); this keeps the command working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_the_one_process_pipeline_bench_runs_with_its_floor(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [
            sys.executable, str(REPO / "bench" / "pipeline.py"), "--quick", "--levels", "1",
            "--no-profile", "--floor-claim", "--out", str(tmp_path),
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=230, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "pipeline-latest.json").read_text())
    pipe = report["pipeline"]
    assert pipe["levels"]["1"]["requests"] > 0
    assert pipe["levels"]["1"]["errors"] == 0, pipe["levels"]["1"]["error_samples"]
    assert set(pipe["idle_cpu_cores"]) == {"python", "nats_server", "mock"}
    # --floor-claim: the claim variant too (adapter with Ren-Queue's terminal claim).
    assert set(pipe["floor"]) == {"adapter", "aiohttp", "claim"}
    # Measured once the pipeline's processes were idle again (the wait is bounded).
    assert set(pipe["floor_settle_seconds"]) == {"1"}
    for variant, levels in pipe["floor"].items():
        row = levels["1"]
        assert row["requests"] > 0, variant
        assert row["errors"] == 0, row["error_samples"]
        assert row["python_cpu_ms_per_request"] > 0
        assert row["python_idle_ms_per_request"] is not None
        # Exactly the pipeline's five: the request, the dispatch, three events; and the
        # claim variant's terminal claim, as rq-terminal's.
        assert row["stored_msgs_per_request"] == {
            "FLOOR_REQUESTS": 1.0,
            "FLOOR_DISPATCH": 1.0,
            "FLOOR_EVENTS": 3.0,
            "KV_floor-terminal": 1.0 if variant == "claim" else 0.0,
        }
        got = report["floor_analysis"]["1"][variant]
        assert got["floor_added_p50_ms"] is not None
        assert got["pipeline_over_floor_requests_per_s"] > 0
        assert got["pipeline_over_floor_python_cpu"] > 0
    assert pipe["floor_service_errors"] == {}
    assert "The floor (bench/_floor.py" in done.stdout
    assert "Left out of the floor" in done.stdout
