"""The gateway's speed (issue #11): requests/s and added latency through ``renqueue
gateway`` against a direct call to the same mock, and LiteLLM's proxy on the same mock,
in the same run.

Three sides, each a server in processes of its own, in front of one mock backend
(``renqueue mock-backend`` in its own process; answers at once, 16 tokens):

1. **direct**: the load client calls the mock itself: the floor.
   **client**: Ren-Queue's Python ``Client`` over NATS against the same ``renqueue up``
   as side 2, no HTTP: what the queue behind the gateway costs by itself, so that
   "renqueue" minus "client" is the gateway's own share.
2. **Ren-Queue**: ``renqueue up`` (embedded nats-server, a router, a worker and the
   gateway, as a user runs it) with one backend, the mock; the client calls the gateway
   with an API key.
3. **LiteLLM proxy**: ``litellm --config`` (one model group, the mock, a master key;
   no database), from the benchmark-only venv ``.renqueue/bench-litellm/venv`` (made on
   first run with ``litellm[proxy]``'s packages; never a dependency of Ren-Queue).

All three run for the whole benchmark; each cell (a mode and a concurrency level) measures
the sides back to back, so a shared machine's changing load weighs on them alike. The
load client is closed-loop: ``concurrency`` tasks each send a request as soon as
their last one has ended, for ``--seconds`` at each level, after a short warm-up; not
streamed (a whole ``chat.completion``) and streamed (SSE to ``data: [DONE]``). It runs
in this process on the same 2 cores as the servers, for every side alike. Added
latency is a side's median latency minus the direct call's at the same level (for
streams: the median time to the first token, and to the end).

Results: a table on stdout, JSON in ``bench/results/gateway-<UTC>.json`` and
``bench/results/gateway-latest.json``.

    .venv/bin/python bench/gateway.py                 # make bench-gateway
    .venv/bin/python bench/gateway.py --levels 1 16 --seconds 5 --no-litellm
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    LITELLM_DIR,
    LITELLM_SPEC,
    RESULTS,
    ROOT,
    free_port,
    litellm_env,
    litellm_python,
    machine_info,
    mock_process,
    mock_stats,
    package_version,
    percentile,
)

from renqueue import Client
from renqueue.gateway import digest

KEY = "rq-bench-gateway-key-0123456789abcdef"
LITELLM_KEY = "sk-bench-master-key"
OUTPUT_TOKENS = 16
BODY = {
    "model": "chat",
    "messages": [{"role": "user", "content": "Say something short."}],
    "max_tokens": OUTPUT_TOKENS,
}
#: The proxy needs these beside ``LITELLM_SPEC`` (its ``proxy`` extra, less the pinned
#: ``litellm-proxy*`` and ``litellm-enterprise`` packages the index here lacks).
LITELLM_PROXY_PACKAGES = (
    "uvicorn>=0.33,<1",
    "uvloop>=0.22.1,<1",
    "gunicorn>=23,<24",
    "fastapi>=0.136.3,<1",
    "starlette>=1.0.1,<2",
    "backoff>=2.2.1,<3",
    "rq>=2.7,<3",
    "orjson>=3.11.6,<4",
    "apscheduler>=3.11.2,<4",
    "fastapi-sso>=0.19,<1",
    "pyjwt>=2.13,<3",
    "python-multipart>=0.0.27,<1",
    "cryptography>=49,<51",
    "pynacl>=1.6.2,<2",
    "websockets>=15.0.1,<16",
    "mcp>=2.3,<3",
    "httpx2>=2.10,<3",
    "rich>=13.9.4,<14",
    "inquirerpy>=0.3.4,<1",
    "tomlkit>=0.13.3,<1",
    "semver>=3.0.4,<4",
    "expression>=5.6,<6",
    "restrictedpython>=8.5,<9",
    "backports-zstd>=1,<2",
    "hiredis>=3,<4",
    "soundfile>=0.12.1,<1",
)


# ------------------------------------------------------------------ load client


async def one_call(
    http: aiohttp.ClientSession, url: str, key: str, stream: bool
) -> tuple[float, float]:
    """One request: (seconds to the first token, seconds to the end); raises on failure."""
    body = {**BODY, "stream": True} if stream else BODY
    start = time.perf_counter()
    first = 0.0
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url, json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        if not stream:
            data = await response.json()
            if not data["choices"][0]["message"]["content"]:
                raise RuntimeError("empty answer")
            end = time.perf_counter() - start
            return end, end
        done = False
        async for line in response.content:
            if (
                not first
                and line.startswith(b"data: {")
                and b'"content":"' in line
                and b'"content":""' not in line
            ):
                first = time.perf_counter() - start
            if line.startswith(b"data: [DONE]"):
                done = True
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
    return first, time.perf_counter() - start


async def closed_loop(
    url: str, key: str, *, stream: bool, concurrency: int, seconds: float, warmup: float
) -> dict[str, Any]:
    """``concurrency`` tasks sending back to back for ``seconds`` (after ``warmup``)."""
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    firsts: list[float] = []
    ends: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        loop = asyncio.get_running_loop()
        measure_from = loop.time() + warmup
        stop_at = measure_from + seconds

        async def worker() -> None:
            while loop.time() < stop_at:
                began = loop.time()
                try:
                    first, end = await one_call(http, url, key, stream)
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    if began >= measure_from:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                if began >= measure_from and loop.time() <= stop_at:
                    firsts.append(first)
                    ends.append(end)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _row(concurrency, stream, seconds, firsts, ends, errors)


async def client_loop(
    nats_url: str, _key: str, *, stream: bool, concurrency: int, seconds: float, warmup: float
) -> dict[str, Any]:
    """As :func:`closed_loop`, through Ren-Queue's Python ``Client`` over NATS (no HTTP):
    what the pipeline behind the gateway costs by itself."""
    firsts: list[float] = []
    ends: list[float] = []
    errors: list[str] = []
    async with await Client.connect(nats_url, tenant="bench-client") as client:
        loop = asyncio.get_running_loop()
        measure_from = loop.time() + warmup
        stop_at = measure_from + seconds

        async def one() -> tuple[float, float]:
            start = time.perf_counter()
            first = 0.0
            handle = await client.submit(BODY["messages"], route="chat", max_tokens=OUTPUT_TOKENS)
            if stream:
                async for chunk in handle.stream():
                    if not first and chunk.text:
                        first = time.perf_counter() - start
            result = await handle.result()
            if not result.text:
                raise RuntimeError("empty answer")
            end = time.perf_counter() - start
            return first or end, end

        async def worker() -> None:
            while loop.time() < stop_at:
                began = loop.time()
                try:
                    first, end = await one()
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    if began >= measure_from:
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                if began >= measure_from and loop.time() <= stop_at:
                    firsts.append(first)
                    ends.append(end)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _row(concurrency, stream, seconds, firsts, ends, errors)


def _row(
    concurrency: int,
    stream: bool,
    seconds: float,
    firsts: list[float],
    ends: list[float],
    errors: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "stream": stream,
        "requests": len(ends),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "rps": len(ends) / seconds,
        "p50_ms": percentile(ends, 50) * 1000,
        "p99_ms": percentile(ends, 99) * 1000,
    }
    if stream:
        out["ttft_p50_ms"] = percentile(firsts, 50) * 1000
        out["ttft_p99_ms"] = percentile(firsts, 99) * 1000
    return out


# ------------------------------------------------------------------------ sides


async def wait_ready(url: str, proc: asyncio.subprocess.Process, what: str, limit: float) -> None:
    give_up = time.monotonic() + limit
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < give_up:
            if proc.returncode is not None:
                raise RuntimeError(f"{what} exited {proc.returncode} while starting")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url) as response:
                    if response.status < 500:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} did not answer {url} within {limit:g} s")


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()


#: Processes whose CPU time is read around each cell of the side named (``/proc``):
#: ``renqueue up`` (and the gateway's own process with ``--split-gateway``).
CPU_PIDS: dict[str, dict[str, int]] = {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def renqueue_side(
    mock_url: str, workdir: Path, *, split: bool = False, profile: Path | None = None
) -> AsyncIterator[tuple[str, str]]:
    """``renqueue up`` with the gateway (``split``: ``renqueue up`` without it, and
    ``renqueue gateway`` in a process of its own); its chat-completions URL and its
    NATS URL. ``profile``: a folder where each process writes its cProfile stats
    (``up.prof``, ``gateway.prof``: CPU time, ``bench/_profiled.py``) when it stops."""

    def python(name: str) -> list[str]:
        if profile is None:
            return [sys.executable]
        profile.mkdir(parents=True, exist_ok=True)
        script = Path(__file__).resolve().parent / "_profiled.py"
        return [sys.executable, str(script), str(profile / f"{name}.prof")]

    port = free_port()
    config = workdir / "renqueue.toml"
    config.write_text(
        f"""
[nats]
data_dir = "{workdir / "nats"}"
port = -1

[backends.mock]
base_url = "{mock_url}"
model = "mock"
limits = {{ concurrency = 256 }}

[routes.chat]
backends = ["mock"]

[gateway]
port = {port}
keys = [{{ tenant = "bench", sha256 = "{digest(KEY)}" }}]
enabled = {"false" if split else "true"}
"""
    )
    log = (workdir / "renqueue.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        *python("up"),
        "-m",
        "renqueue",
        "--log-level",
        "WARNING",
        "-c",
        str(config),
        "up",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=workdir,
    )
    gateway: asyncio.subprocess.Process | None = None
    try:
        url_file = workdir / "nats" / "nats.url"
        if split:
            for _ in range(600):
                if url_file.exists() and proc.returncode is None:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # provisioning, after the url file is written
            gateway = await asyncio.create_subprocess_exec(
                *python("gateway"), "-m", "renqueue", "--log-level", "WARNING", "-c", str(config),
                "--nats", url_file.read_text().strip(), "gateway",
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, cwd=workdir,
            )  # fmt: skip
        await wait_ready(f"http://127.0.0.1:{port}/health", gateway or proc, "the gateway", 60)
        pids = {"up": proc.pid}
        if gateway is not None:
            pids["gateway"] = gateway.pid
        CPU_PIDS["renqueue"] = CPU_PIDS["client"] = pids
        yield f"http://127.0.0.1:{port}/v1/chat/completions", url_file.read_text().strip()
    finally:
        if gateway is not None:
            await stop(gateway)
        await stop(proc)
        log.close()


@contextlib.asynccontextmanager
async def litellm_side(python: Path, mock_url: str, workdir: Path) -> AsyncIterator[str]:
    """LiteLLM's proxy (``litellm --config``); its chat-completions URL."""
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        f"""
model_list:
  - model_name: chat
    litellm_params:
      model: openai/mock
      api_base: {mock_url}
      api_key: mock-key
litellm_settings:
  telemetry: false
  drop_params: false
general_settings:
  master_key: {LITELLM_KEY}
"""
    )
    log = (workdir / "litellm.log").open("w")
    cli = python.parent / "litellm"
    proc = await asyncio.create_subprocess_exec(
        # Run by the venv's Python, not by the script's shebang: a venv made
        # at another path (a moved checkout) keeps the old path there.
        str(python),
        str(cli),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env=litellm_env(),
        cwd=workdir,
    )
    try:
        await wait_ready(f"http://127.0.0.1:{port}/health/liveliness", proc, "litellm", 180)
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        await stop(proc)
        log.close()


def litellm_proxy_python(fresh: bool) -> tuple[Path | None, str]:
    """The LiteLLM venv's Python with the proxy's packages (installed on first use)."""
    python, note = litellm_python(fresh)
    if python is None:
        return None, note
    stamp = LITELLM_DIR / "venv" / ".bench-proxy-installed"
    wanted = "\n".join((LITELLM_SPEC, *LITELLM_PROXY_PACKAGES))
    if not fresh and stamp.exists() and stamp.read_text() == wanted:
        return python, note + ", proxy packages (cached)"
    print("  installing the LiteLLM proxy's packages in its venv ...", flush=True)
    step = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*step, *LITELLM_PROXY_PACKAGES], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        return None, f"pip install of the proxy's packages failed: {' | '.join(lines[-3:])}"
    stamp.write_text(wanted)
    return python, note + ", proxy packages (installed now)"


def litellm_version(python: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


# ------------------------------------------------------------------------- run


async def measure(
    side: str, url: str, key: str, args: argparse.Namespace, stream: bool, level: int
) -> dict[str, Any]:
    loop_of = client_loop if side == "client" else closed_loop
    pids = CPU_PIDS.get(side, {})
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    row = await loop_of(
        url, key, stream=stream, concurrency=level, seconds=args.seconds, warmup=args.warmup
    )
    row["side"] = side
    # CPU per request over the whole cell (warm-up included): an estimate.
    done = max(1.0, row["rps"] * (args.seconds + args.warmup))
    for name, pid in pids.items():
        row[f"cpu_ms_per_request_{name}"] = 1000 * (cpu_seconds(pid) - before[name]) / done
    cpu = "  ".join(f"{name} CPU {row[f'cpu_ms_per_request_{name}']:.2f} ms/req" for name in pids)
    print(
        f"  {side:<9} {'stream' if stream else 'whole':<6} c={level:<3} {row['rps']:8.1f} req/s"
        f"  p50 {row['p50_ms']:7.2f} ms  errors {row['errors']}  {cpu}",
        flush=True,
    )
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "benchmark": "gateway",
        "machine": machine_info(aiohttp=package_version("aiohttp")),
        "settings": {
            "levels": args.levels,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "output_tokens": OUTPUT_TOKENS,
        },
        "rows": rows,
    }
    python: Path | None = None
    if not args.no_litellm:
        python, note = await asyncio.to_thread(litellm_proxy_python, args.fresh_litellm)
        report["litellm_install"] = note
        if python is None:
            report["litellm_missing"] = note
            print(f"  LiteLLM proxy: not run: {note}")
        else:
            report["machine"]["litellm"] = litellm_version(python)
    with tempfile.TemporaryDirectory(prefix="rq-bench-gateway-") as tmp:
        workdir = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            mock_url, _pid = await stack.enter_async_context(
                mock_process(ttft=0.0, output_tokens=OUTPUT_TOKENS)
            )
            # Every side runs at once, idle but for the one measured: the sides of a cell
            # are measured back to back, so a machine whose load changes over the run
            # (it is shared) weighs on them alike.
            targets: dict[str, tuple[str, str]] = {}
            if "direct" in args.sides:
                targets["direct"] = (mock_url + "/chat/completions", "mock-key")
            if "renqueue" in args.sides or "client" in args.sides:
                (workdir / "rq").mkdir()
                url, nats_url = await stack.enter_async_context(
                    renqueue_side(
                        mock_url, workdir / "rq", split=args.split_gateway, profile=args.profile
                    )
                )
                if "client" in args.sides:
                    targets["client"] = (nats_url, "")
                if "renqueue" in args.sides:
                    targets["renqueue"] = (url, KEY)
            if python is not None and "litellm" in args.sides:
                (workdir / "litellm").mkdir()
                try:
                    url = await stack.enter_async_context(
                        litellm_side(python, mock_url, workdir / "litellm")
                    )
                    targets["litellm"] = (url, LITELLM_KEY)
                except RuntimeError as exc:
                    tail = (workdir / "litellm" / "litellm.log").read_text()[-1500:]
                    report["litellm_missing"] = f"{exc}: {tail}"
                    print(f"  LiteLLM proxy: not run: {exc}")
            for stream in (False, True):
                for level in args.levels:
                    for side, (url, key) in targets.items():
                        rows.append(await measure(side, url, key, args, stream, level))
            report["mock"] = await mock_stats(mock_url)
            report["mock"].pop("last_request", None)
    report["summary"] = summarize(rows)
    return report


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and level: each side's req/s and its added median latency over direct."""
    out = []
    by = {(r["side"], r["stream"], r["concurrency"]): r for r in rows}
    for (side, stream, level), row in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if side in ("direct", "client"):
            continue
        direct = by.get(("direct", stream, level))
        other = by.get(("litellm" if side == "renqueue" else "renqueue", stream, level))
        entry: dict[str, Any] = {
            "side": side,
            "stream": stream,
            "concurrency": level,
            "rps": row["rps"],
            "added_p50_ms": None if direct is None else row["p50_ms"] - direct["p50_ms"],
        }
        if stream and direct is not None:
            entry["added_ttft_p50_ms"] = row["ttft_p50_ms"] - direct["ttft_p50_ms"]
        if side == "renqueue" and other is not None and other["rps"] > 0:
            entry["rps_vs_litellm"] = row["rps"] / other["rps"]
        out.append(entry)
    return out


def print_report(report: dict[str, Any]) -> None:
    rows = report["rows"]
    machine = report["machine"]
    print()
    print(
        f"Gateway benchmark: {machine['cpu_count']} cores, Python {machine['python']}, "
        f"aiohttp {machine.get('aiohttp')}, LiteLLM {machine.get('litellm', 'not run')}"
    )
    print(
        f"closed loop, {report['settings']['seconds']:g} s per cell, mock answers at once "
        f"with {OUTPUT_TOKENS} tokens"
    )
    header = (
        f"{'side':<9} {'mode':<6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'ttft p50':>9} {'added p50':>10} {'errors':>6}"
    )
    print(header)
    print("-" * len(header))
    by = {(r["side"], r["stream"], r["concurrency"]): r for r in rows}
    for row in rows:
        direct = by.get(("direct", row["stream"], row["concurrency"]))
        added = (
            ""
            if row["side"] == "direct" or direct is None
            else (f"{row['p50_ms'] - direct['p50_ms']:+.2f}")
        )
        ttft = f"{row['ttft_p50_ms']:.2f}" if row["stream"] else ""
        print(
            f"{row['side']:<9} {'stream' if row['stream'] else 'whole':<6} "
            f"{row['concurrency']:>4} {row['rps']:>9.1f} {row['p50_ms']:>8.2f} "
            f"{row['p99_ms']:>8.2f} {ttft:>9} {added:>10} {row['errors']:>6}"
        )
    print()
    for row in rows:
        if row["side"] != "renqueue":
            continue
        client = by.get(("client", row["stream"], row["concurrency"]))
        if client is not None:
            mode = "stream" if row["stream"] else "whole"
            print(
                f"the gateway's own share, {mode}, concurrency {row['concurrency']}: "
                f"{row['p50_ms'] - client['p50_ms']:+.2f} ms p50 over the Client, "
                f"{row['rps'] / client['rps']:.2f}x its requests/s"
            )
    ratios = [e for e in report["summary"] if "rps_vs_litellm" in e]
    if ratios:
        print()
        for entry in ratios:
            mode = "stream" if entry["stream"] else "whole"
            print(
                f"Ren-Queue / LiteLLM proxy, {mode}, concurrency {entry['concurrency']}: "
                f"{entry['rps_vs_litellm']:.1f}x the requests/s"
            )
    if report.get("litellm_missing"):
        print(f"LiteLLM proxy: not run: {report['litellm_missing'][:300]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured per cell")
    parser.add_argument("--warmup", type=float, default=1.5, help="unmeasured, per cell")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=("direct", "client", "renqueue", "litellm"),
        default=["direct", "client", "renqueue", "litellm"],
        help="which sides to run (default: all)",
    )
    parser.add_argument(
        "--split-gateway",
        action="store_true",
        help="run the gateway as a process of its own (renqueue gateway) beside renqueue up",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="run renqueue up (and the gateway's own process) under cProfile; its stats"
        " go to this folder (up.prof, gateway.prof) when they stop",
    )
    parser.add_argument("--fresh-litellm", action="store_true", help="remake its venv first")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    os.chdir(ROOT)
    report = asyncio.run(run(args))
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(report, indent=2) + "\n"
    (args.out / f"gateway-{stamp}.json").write_text(text)
    (args.out / "gateway-latest.json").write_text(text)


if __name__ == "__main__":
    main()
