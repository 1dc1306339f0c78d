"""The adapters' HTTP client, alone: what one backend call costs the process that makes it.

Run with ``make bench-http`` or ``python bench/http_clients.py [--quick]``. One
instant mock LLM in a child process (``renqueue mock-backend --ttft 0 --tps 0
--output-tokens 8``), called directly (no NATS, no services) by:

- ``raw_aiohttp``: a bare ``aiohttp.ClientSession`` (the floor: what moving the
  bytes costs at all);
- ``adapter_httpcore``: the project's ``OpenAIBackend`` on httpx's own transport
  (httpcore, h11, anyio), its pools sharded as ``renqueue/backends/_http.py`` shards them;
- ``adapter_aiohttp``: the same adapter on ``renqueue/backends/_aiohttp.py``'s
  ``AiohttpTransport`` (httpx's API, aiohttp's pool and parser);

each streamed (SSE, read to the end, as a worker does) and whole (one JSON body),
closed loop at C=1/16/64, on the default asyncio loop and on uvloop. Each cell gets
a fresh client, warmed at its level. The figure to read is **Python CPU ms per
request** (``time.process_time()`` over the window / requests): it is what a call
costs the worker whatever else the shared machine runs; req/s drifts with the load.
Rounds alternate the two loops; the median of the rounds is shown.

Results: a table on stdout, JSON in ``bench/results/http-clients-<UTC>.json`` and
``bench/results/http-clients-latest.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from common import RESULTS, ROOT, machine_info, package_version, percentile

from renqueue.backends.openai import OpenAIBackend
from renqueue.config import parse_config
from renqueue.logs import configure_logging
from renqueue.schema import REQUEST_DECODER, InferenceRequest

OUTPUT_TOKENS = 8
PROMPT = "Say something short."
CLIENTS = ("raw_aiohttp", "adapter_httpcore", "adapter_aiohttp")
MODES = ("streamed", "whole")

Call = Callable[[], Awaitable[None]]


class HttpcoreAdapter(OpenAIBackend):
    transport = "httpcore"


class AiohttpAdapter(OpenAIBackend):
    transport = "aiohttp"


def request() -> InferenceRequest:
    raw = {
        "id": uuid.uuid4().hex,
        "tenant": "bench",
        "route": "chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "submitted_at": time.time(),
    }
    return REQUEST_DECODER.decode(msgspec.json.encode(raw))


def proc_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@contextlib.asynccontextmanager
async def client(name: str, mode: str, url: str, slots: int) -> AsyncIterator[Call]:
    """One call of ``name`` in ``mode`` (it checks the answer), on a fresh client."""
    if name == "raw_aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        streamed = mode == "streamed"
        body = msgspec.json.encode(
            {
                "model": "mock",
                "messages": [{"role": "user", "content": PROMPT}],
                "stream": streamed,
                **({"stream_options": {"include_usage": True}} if streamed else {}),
            }
        )
        accept = "text/event-stream" if streamed else "application/json"
        headers = {"Content-Type": "application/json", "Accept": accept}
        target = url.rstrip("/") + "/chat/completions"

        async def raw() -> None:
            async with session.post(target, data=body, headers=headers) as response:
                response.raise_for_status()
                if streamed:
                    events = 0
                    async for line in response.content:
                        if line.startswith(b"data:"):
                            events += 1
                    if events < OUTPUT_TOKENS:
                        raise RuntimeError(f"expected {OUTPUT_TOKENS} events, got {events}")
                else:
                    answer: Any = msgspec.json.decode(await response.read())
                    text = answer["choices"][0]["message"]["content"]
                    if len(text.split()) != OUTPUT_TOKENS:
                        raise RuntimeError(f"unexpected answer {text!r}")

        try:
            yield raw
        finally:
            await session.close()
        return

    kind = HttpcoreAdapter if name == "adapter_httpcore" else AiohttpAdapter
    config = parse_config(
        {
            "backends": {
                "mock": {"base_url": url, "model": "mock", "limits": {"concurrency": slots}}
            },
            "routes": {"chat": {"backends": ["mock"]}},
        },
        source="<bench>",
    )
    adapter = kind("mock", config.backends["mock"])

    async def streamed_call() -> None:
        text = ""
        stream = adapter.stream(request())
        try:
            async for delta in stream:
                text += delta.text
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        if len(text.split()) != OUTPUT_TOKENS:
            raise RuntimeError(f"unexpected answer {text!r}")

    async def whole_call() -> None:
        generation = await adapter.complete(request())
        if len(generation.text.split()) != OUTPUT_TOKENS:
            raise RuntimeError(f"unexpected answer {generation.text!r}")

    try:
        yield streamed_call if mode == "streamed" else whole_call
    finally:
        await adapter.close()


async def closed_loop(call: Call, concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` tasks repeating ``call`` for ``seconds``: rate, latency, CPU."""
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    end = start + seconds
    last_end = start
    cpu_before = time.process_time()

    async def one() -> None:
        nonlocal last_end
        while time.perf_counter() < end:
            began = time.perf_counter()
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.01)
                continue
            last_end = time.perf_counter()
            latencies.append(last_end - began)

    await asyncio.gather(*(one() for _ in range(concurrency)))
    cpu = time.process_time() - cpu_before
    elapsed = last_end - start
    done = max(1, len(latencies))
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:3],
        "seconds": elapsed,
        "requests_per_s": len(latencies) / elapsed if elapsed else 0.0,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "python_cpu_ms_per_request": cpu / done * 1000,
        "python_cpu_cores": cpu / elapsed if elapsed else 0.0,
    }


async def one_round(
    url: str, mock_pid: int, args: argparse.Namespace, loop_name: str
) -> dict[str, Any]:
    """Every client, mode and level once, on the running loop."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for level in args.levels:
            for name in CLIENTS:
                async with client(name, mode, url, args.slots) as call:
                    await closed_loop(call, level, args.warmup)
                    mock_before, wall = proc_cpu_seconds(mock_pid), time.perf_counter()
                    cell = await closed_loop(call, level, args.seconds)
                    cell["mock_cpu_cores"] = (proc_cpu_seconds(mock_pid) - mock_before) / (
                        time.perf_counter() - wall
                    )
                out[f"{mode}/{level}/{name}"] = cell
                print(
                    f"  {loop_name:7} {mode:8} C={level:<3} {name:17}"
                    f" {cell['requests_per_s']:7,.0f} req/s"
                    f" {cell['python_cpu_ms_per_request']:6.3f} cpu ms/req"
                    + (f"  {cell['errors']} errors" if cell["errors"] else ""),
                    flush=True,
                )
    return out


def run_on(loop_name: str, main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    if loop_name == "uvloop":
        import uvloop  # noqa: PLC0415 - only when asked for

        return uvloop.run(main)
    return asyncio.run(main)


@contextlib.contextmanager
def mock_server() -> Any:
    """The instant mock in a process of its own: (base URL, pid)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "renqueue",
            "--log-level",
            "WARNING",
            "mock-backend",
            "--port",
            "0",
            "--ttft",
            "0",
            "--tps",
            "0",
            "--output-tokens",
            str(OUTPUT_TOKENS),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        url = line.rsplit(" ", 1)[-1]
        if not url.startswith("http"):
            raise RuntimeError(f"mock backend did not start: {line!r}")
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median_cells(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cell, the median over rounds of each number."""
    cells: dict[str, Any] = {}
    for key in rounds[0]:
        values = [each[key] for each in rounds]
        cells[key] = {
            field: statistics.median(v[field] for v in values)
            for field in values[0]
            if isinstance(values[0][field], int | float)
        }
    return cells


def print_report(report: dict[str, Any]) -> None:
    print()
    print("  Python CPU ms per request (req/s), median of rounds; x: adapter / raw aiohttp CPU")
    header = f"  {'mode':8} {'loop':7} {'C':>3}"
    for name in CLIENTS:
        header += f" {name:>24}"
    print(header)
    for mode in MODES:
        for loop_name in report["loops"]:
            cells = report["results"][loop_name]
            for level in report["levels"]:
                row = f"  {mode:8} {loop_name:7} {level:>3}"
                raw = cells[f"{mode}/{level}/raw_aiohttp"]["python_cpu_ms_per_request"]
                for name in CLIENTS:
                    cell = cells[f"{mode}/{level}/{name}"]
                    ms = cell["python_cpu_ms_per_request"]
                    ratio = f" {ms / raw:4.1f}x" if name != "raw_aiohttp" and raw else "      "
                    row += f" {ms:6.3f} ({cell['requests_per_s']:6,.0f}){ratio}"
                print(row)
    base = report["results"][report["loops"][0]]
    print()
    print("  adapter_aiohttp CPU / adapter_httpcore CPU (same loop, same cell):")
    for loop_name in report["loops"]:
        cells = report["results"][loop_name]
        parts = []
        for mode in MODES:
            for level in report["levels"]:
                new = cells[f"{mode}/{level}/adapter_aiohttp"]["python_cpu_ms_per_request"]
                old = cells[f"{mode}/{level}/adapter_httpcore"]["python_cpu_ms_per_request"]
                parts.append(f"{mode[0]}{level}={new / old:.2f}" if old else "-")
        print(f"    {loop_name:7} " + "  ".join(parts))
    if len(report["loops"]) > 1:
        other = report["results"][report["loops"][1]]
        print(f"  {report['loops'][1]} CPU / {report['loops'][0]} CPU (same client, same cell):")
        for name in CLIENTS:
            parts = []
            for mode in MODES:
                for level in report["levels"]:
                    key = f"{mode}/{level}/{name}"
                    old = base[key]["python_cpu_ms_per_request"]
                    new = other[key]["python_cpu_ms_per_request"]
                    parts.append(f"{mode[0]}{level}={new / old:.2f}" if old else "-")
            print(f"    {name:17} " + "  ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s windows (~1 min)")
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels (1,16,64)")
    parser.add_argument("--loops", default="asyncio,uvloop", help="event loops (asyncio,uvloop)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (3; --quick: 1)")
    parser.add_argument("--seconds", type=float, default=None, help="window (2 s; --quick: 1)")
    parser.add_argument("--slots", type=int, default=256, help="the backend's concurrency (256)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON")
    args = parser.parse_args()
    args.levels = [int(level) for level in args.levels.split(",")]
    loops = args.loops.split(",")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (1.0 if args.quick else 2.0)
    args.warmup = 0.3 if args.quick else 0.5
    configure_logging(level="WARNING")
    started = time.perf_counter()
    timestamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    with mock_server() as (url, pid):
        for index in range(args.rounds):
            order = loops if index % 2 == 0 else loops[::-1]
            for loop_name in order:
                rounds[loop_name].append(run_on(loop_name, one_round(url, pid, args, loop_name)))
    report = {
        "timestamp": timestamp,
        "machine": machine_info(
            aiohttp=aiohttp.__version__,
            httpx=package_version("httpx"),
            httpcore=package_version("httpcore"),
            uvloop=package_version("uvloop"),
        ),
        "levels": args.levels,
        "loops": loops,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "results": {name: median_cells(each) for name, each in rounds.items()},
        "rounds_detail": rounds,
        "total_seconds": time.perf_counter() - started,
    }
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"http-clients-{timestamp}.json"
    text = json.dumps(report, indent=2) + "\n"
    path.write_text(text)
    (args.out / "http-clients-latest.json").write_text(text)
    print(f"\n  JSON: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"  total {report['total_seconds']:.0f}s")


if __name__ == "__main__":
    main()
