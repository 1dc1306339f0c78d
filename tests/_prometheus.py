"""Prometheus's own tools for the tests of deploy/: promtool, and a real
Prometheus server on loopback.

Both come from Debian's ``prometheus`` package, which ``make tools`` (a step of
``make test``) installs when missing. A test that cannot find them fails and
says so: a skipped check of the alerts would pass unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"


def tool(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``; fails the test when missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not on PATH: `make tools` installs it (Debian's prometheus package; "
            "`make test` runs that step first)",
            pytrace=False,
        )
    return path


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``promtool`` with ``args``; its exit code and output, whatever they are."""
    return subprocess.run(
        [tool("promtool"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=cwd,
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules(rules: Any) -> list[dict[str, Any]]:
    """Every alerting rule of a rules file's groups."""
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


# --------------------------------------------------------------------- PromQL, read simply

_NAME = re.compile(r"\b(renqueue_[a-z0-9_]+|up)\b(?!\s*\()")
_MATCHER = re.compile(r"(?<!\{)\{([^{}]*)\}(?!\})")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_TEMPLATE_LABEL = re.compile(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)")


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (ours, and Prometheus's ``up``)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return set(_NAME.findall(without_strings))


def label_names(expr: str) -> set[str]:
    """The label names a PromQL expression matches on or groups by."""
    names: set[str] = set()
    for body in _MATCHER.findall(expr):
        names.update(_MATCHER_LABEL.findall(re.sub(r'"[^"]*"', '""', body)))
    for body in _GROUPING.findall(expr):
        names.update(part.strip() for part in body.split(",") if part.strip())
    return names


def legend_labels(legend: str) -> set[str]:
    """Labels a Grafana legend shows (``{{backend}}``)."""
    return set(_LEGEND.findall(legend))


def template_labels(text: str) -> set[str]:
    """Labels an alert's annotation templates show (``$labels.backend``)."""
    return set(_TEMPLATE_LABEL.findall(text))


# ------------------------------------------------------------------------ a real Prometheus


@contextlib.asynccontextmanager
async def prometheus(config: Path, data: Path, *, within: float = 30.0) -> AsyncIterator[str]:
    """The Prometheus binary on 127.0.0.1 (a free port) with ``config`` and a
    data dir of its own, for the block; its base URL once it is ready."""
    proc = await asyncio.create_subprocess_exec(
        tool("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        "--web.listen-address=127.0.0.1:0",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    address: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_log() -> None:
        # Reads its log to the end, so the pipe never fills; the address from "Listening on".
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            lines.append(line)
            found = re.search(r'msg="Listening on" address=(\S+)', line)
            if found and not address.done():
                address.set_result(found.group(1))
        if not address.done():
            address.set_exception(AssertionError("prometheus exited:\n" + "\n".join(lines)))

    reader = asyncio.create_task(read_log())
    try:
        url = f"http://{await asyncio.wait_for(address, within)}"
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + within
            while (await http.get("/-/ready")).status_code != 200:
                if loop.time() > deadline:
                    pytest.fail("prometheus not ready:\n" + "\n".join(lines[-30:]))
                await asyncio.sleep(0.05)  # poll interval while it loads its rules
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
