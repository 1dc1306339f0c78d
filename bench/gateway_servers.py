"""Which HTTP server for the gateway (issue #11): the same tiny chat-completions endpoint
(``bench/_server_candidates.py``) on each candidate, under the load client of
``bench/gateway.py``.

Candidates: aiohttp's server (asyncio loop), uvicorn + Starlette (uvicorn's standard
extras: httptools and uvloop), granian + Starlette (ASGI; Rust HTTP, one worker), and a
raw asyncio protocol with h11. Each runs in a process of its own, from the
benchmark-only venv ``.renqueue/bench-servers/venv`` (made on first run), and is
measured not streamed (a fixed ``chat.completion``) and streamed (18 SSE events, each
written on its own), closed-loop at each level. Besides requests/s and latency, the
server process's CPU time per request (from ``/proc``): the load client shares the
2 cores, so req/s is partly the client's, and CPU per request is the server's own.

Results: a table on stdout, JSON in ``bench/results/gateway-servers-<UTC>.json`` and
``bench/results/gateway-servers-latest.json``.

    .venv/bin/python bench/gateway_servers.py --levels 1 16 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, free_port, machine_info
from gateway import closed_loop, stop, wait_ready

BENCH = Path(__file__).resolve().parent
VENV = ROOT / ".renqueue" / "bench-servers" / "venv"
PACKAGES = ("aiohttp==3.14.5", "uvicorn[standard]", "starlette", "granian", "h11")
CANDIDATES = ("aiohttp", "uvicorn+starlette", "granian+starlette", "h11")


def venv_python() -> Path:
    python = VENV / "bin" / "python"
    stamp = VENV / ".bench-installed"
    if python.exists() and stamp.exists() and stamp.read_text() == "\n".join(PACKAGES):
        return python
    print(f"  making {VENV.relative_to(ROOT)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PACKAGES],
        check=True,
    )
    stamp.write_text("\n".join(PACKAGES))
    return python


def command(kind: str, python: Path, port: int) -> list[str]:
    bin_dir = python.parent
    if kind == "aiohttp":
        return [str(python), str(BENCH / "_server_candidates.py"), "aiohttp", str(port)]
    if kind == "h11":
        return [str(python), str(BENCH / "_server_candidates.py"), "h11", str(port)]
    if kind == "uvicorn+starlette":
        return [
            str(bin_dir / "uvicorn"),
            "--app-dir",
            str(BENCH),
            "_server_candidates:asgi_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ]
    return [
        str(bin_dir / "granian"),
        "--interface",
        "asgi",
        "--working-dir",
        str(BENCH),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--no-ws",
        "--log-level",
        "warning",
        "_server_candidates:asgi_app",
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its children that were waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU of ``pid`` and its live children (granian's worker is a child process)."""
    total = cpu_seconds(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            total += tree_cpu(int(child))
    return total


async def run(args: argparse.Namespace) -> dict[str, Any]:
    python = await asyncio.to_thread(venv_python)
    rows: list[dict[str, Any]] = []
    for kind in args.candidates:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            *command(kind, python, port),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await wait_ready(f"http://127.0.0.1:{port}/health", proc, kind, 30)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            for stream in (False, True):
                for level in args.levels:
                    before = tree_cpu(proc.pid)
                    row = await closed_loop(
                        url,
                        "none",
                        stream=stream,
                        concurrency=level,
                        seconds=args.seconds,
                        warmup=0.0,
                    )
                    used = tree_cpu(proc.pid) - before
                    row["server"] = kind
                    row["server_cpu_ms_per_request"] = 1000 * used / max(1, row["requests"])
                    rows.append(row)
                    print(
                        f"  {kind:<18} {'stream' if stream else 'whole':<6} c={level:<3} "
                        f"{row['rps']:8.1f} req/s  p50 {row['p50_ms']:6.2f} ms  "
                        f"server CPU {row['server_cpu_ms_per_request']:.3f} ms/req",
                        flush=True,
                    )
        finally:
            await stop(proc)
    return {"benchmark": "gateway-servers", "machine": machine_info(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--candidates", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print()
    print(f"{'server':<18} {'mode':<6} {'conc':>4} {'req/s':>8} {'p50 ms':>7} {'cpu ms/req':>10}")
    for row in report["rows"]:
        print(
            f"{row['server']:<18} {'stream' if row['stream'] else 'whole':<6} "
            f"{row['concurrency']:>4} {row['rps']:>8.1f} {row['p50_ms']:>7.2f} "
            f"{row['server_cpu_ms_per_request']:>10.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(report, indent=2) + "\n"
    (args.out / f"gateway-servers-{stamp}.json").write_text(text)
    (args.out / "gateway-servers-latest.json").write_text(text)


if __name__ == "__main__":
    main()
