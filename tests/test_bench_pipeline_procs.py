"""``bench/pipeline.py --procs`` (bench/README.md, *Separate processes*; ``make
bench-procs``): the deployed shape starts (a nats-server, ``renqueue router`` and
``renqueue worker`` processes, the mock in its own), the client's requests complete
through it, every process's CPU is counted, the floor (the same five stored messages
with no Ren-Queue logic, ``bench/_floor.py``) is measured beside it in both HTTP
variants, the profile window gets a profile from each service process, and no service
exits by itself. LiteLLM's Router side runs only
where its venv is already made (making it takes minutes and the network). Rates are
not checked here (speed belongs to the bench); this keeps the command working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
LITELLM_VENV = REPO / ".renqueue" / "bench-litellm" / "venv"


def _ptrace_refused(why: str) -> bool:
    """py-spy reads another process's memory: a machine that forbids it (a
    container without CAP_SYS_PTRACE, Yama's ptrace_scope) refuses it."""
    why = why.lower()
    return any(word in why for word in ("permission denied", "operation not permitted", "ptrace"))


def run_procs(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
    done = subprocess.run(
        [
            sys.executable, str(REPO / "bench" / "pipeline.py"), "--procs", "--quick",
            "--levels", "2", "--seconds", "1", "--workers", "1", "--out", str(tmp_path),
            *extra,
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=230, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "pipeline-procs-latest.json").read_text()), done.stdout


@pytest.mark.timeout(240)
def test_the_separate_process_pipeline_bench_runs(tmp_path: Path) -> None:
    report, stdout = run_procs(tmp_path, "--no-litellm")
    procs = report["procs"]
    assert procs["shape"] == {"routers": 1, "workers": 1, "slots": 256}
    assert procs["service_self_exits"] == []
    names = {"client", "router-0", "worker-mock-0", "nats_server", "mock"}
    assert set(procs["idle_cpu_cores"]) == names
    for level in ("2",):
        row = procs["levels"][level]
        assert row["requests"] > 0
        assert row["errors"] == 0, row["error_samples"]
        assert set(row["cpu_ms_per_request"]) == names
        # Every completed request stored something in the log (how much is not this
        # test's business: other work changes it).
        assert row["stored_msgs_per_request_total"] > 0
        assert report["analysis"][level]["added_p50_ms"] is not None
    # The floor (bench/_floor.py): the same durable steps with no Ren-Queue logic, its
    # router and workers processes of their own, in both HTTP variants at every level.
    assert set(procs["floor"]) == {"adapter", "aiohttp"}
    for variant, levels in procs["floor"].items():
        row = levels["2"]
        assert row["requests"] > 0, variant
        assert row["errors"] == 0, row["error_samples"]
        assert set(row["cpu_ms_per_request"]) == {
            "client", "floor-router", "floor-worker-0", "nats_server", "mock",
        }  # fmt: skip
        assert row["python_cpu_ms_per_request"] > 0
        # Exactly the pipeline's five: the request, the dispatch, three events.
        assert row["stored_msgs_per_request"] == {
            "FLOOR_REQUESTS": 1.0,
            "FLOOR_DISPATCH": 1.0,
            "FLOOR_EVENTS": 3.0,
            "KV_floor-terminal": 0.0,  # the claim variant only (--floor-claim)
        }
        got = report["floor_analysis"]["2"][variant]
        assert got["floor_added_p50_ms"] is not None
        assert got["pipeline_over_floor_requests_per_s"] > 0
        assert got["pipeline_over_floor_python_cpu"] > 0
    assert "The floor (bench/_floor.py" in stdout
    assert set(procs["floor_settle_seconds"]) == {"2"}
    profiled = procs["profile"]["processes"]
    assert set(profiled) == {"router-0", "worker-mock-0"}
    for got in profiled.values():
        if "missing" in got and _ptrace_refused(got["missing"]):
            continue  # a container without ptrace: the bench says so and goes on
        assert "missing" not in got, got
        assert got["samples"] > 0
        assert got["top_own"]
    assert report["litellm_missing"] == "--no-litellm"
    assert "LiteLLM: not run: --no-litellm" in stdout


@pytest.mark.timeout(240)
def test_litellms_router_runs_beside_it_where_its_venv_is_made(tmp_path: Path) -> None:
    if not (LITELLM_VENV / ".bench-installed").exists():
        pytest.skip(
            "LiteLLM's venv (.renqueue/bench-litellm/venv) is not made: `make bench-procs`"
            " or `make bench-ratelimits` makes it (minutes, from PyPI)"
        )
    report, _stdout = run_procs(tmp_path, "--no-profile")
    litellm = report["litellm"]
    for level in ("2",):
        row = litellm["levels"][level]
        assert row["requests"] > 0
        assert row["errors"] == 0, row["error_samples"]
        assert report["analysis"][level]["vs_litellm_router"] > 0
