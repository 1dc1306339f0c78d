"""docs/metrics.md is a contract (issue 27): every series it lists is exported,
with its type and labels, and every series exported is listed.

A stack as a user runs it: ``renqueue up --metrics-port`` (services and the
gateway) and ``renqueue exporter --port`` beside it, the two commands the page
shows; one request through the gateway, so labelled series have samples. Their
``/metrics`` are parsed with ``prometheus_client.parser``.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from test_cli import until_logged
from test_gateway_cli import completion, free_port, stop, until_healthy, write_config

from renqueue import metrics
from renqueue.coordination import CLUSTER_SERIES
from renqueue.mock import MockBackend, MockSettings

DOC = Path(__file__).parents[1] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(renqueue_\w+)` \| (gauge|counter|histogram) \|\s*([\w, ]*?)\s*\| .+ \|$")
#: prometheus_client's own series, which every process exports (the page says so).
OWN = ("process_", "python_")

Listed = dict[str, tuple[str, frozenset[str]]]


def documented() -> dict[str, Listed]:
    """Each section's series: name -> (type, labels)."""
    sections: dict[str, Listed] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif match := ROW.match(line):
            name, kind, labels = match.groups()
            names = frozenset(label.strip() for label in labels.split(",") if label.strip())
            sections.setdefault(section, {})[name] = (kind, names)
    return sections


def exported(text: str) -> Listed:
    """What a scrape holds: name (counters with ``_total``) -> (type, labels of its samples).

    prometheus_client's own series are left out, and so are the ``<name>_created``
    timestamps it writes beside each counter and histogram (the page says so).
    """
    families = list(text_string_to_metric_families(text))
    timed = {f.name for f in families if f.type in ("counter", "histogram")}
    found: Listed = {}
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        created = name.endswith("_created") and name.removesuffix("_created") in timed
        if name.startswith(OWN) or created:
            continue
        labels = frozenset(key for s in family.samples for key in s.labels if key != "le")
        found[name] = (family.type, labels)
    return found


def assert_same(listed: Listed, scraped: Listed, what: str) -> None:
    assert sorted(set(listed) - set(scraped)) == [], f"listed, not exported by {what}"
    assert sorted(set(scraped) - set(listed)) == [], f"exported by {what}, not listed"
    for name, (kind, labels) in scraped.items():
        assert kind == listed[name][0], name
        if labels:  # a labelled series with no sample yet shows no labels
            assert labels == listed[name][1], name


def test_the_page_lists_the_exporters_own_table() -> None:
    cluster = documented()["Cluster-wide series (the exporter)"]
    assert {s.name: (s.kind, frozenset(s.labels)) for s in CLUSTER_SERIES} == cluster


async def test_the_page_lists_every_series_a_running_stack_exports(tmp_path: Path) -> None:
    sections = documented()
    every = {name: entry for listed in sections.values() for name, entry in listed.items()}
    (per_process,) = (listed for title, listed in sections.items() if title.startswith("Per-"))
    assert len(per_process) == len(
        [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    )  # renqueue/metrics.py
    gateway_port, metrics_port, exporter_port = free_port(), free_port(), free_port()
    env = {**os.environ, "RENQUEUE_CONFIG": ""}
    async with MockBackend(MockSettings(output_tokens=4)) as mock:
        config = write_config(tmp_path, mock.url, gateway_port)
        up_log, exporter_log = tmp_path / "up.log", tmp_path / "exporter.log"
        with up_log.open("wb") as sink:
            up = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(config),
                "up", "--metrics-port", str(metrics_port),
                stdout=sink, stderr=sink, env=env,
            )  # fmt: skip
        exporter = None
        try:
            await until_healthy(f"http://127.0.0.1:{gateway_port}", up, up_log)
            await until_logged(up_log, "running; Ctrl-C to stop", up)
            with exporter_log.open("wb") as sink:
                exporter = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "renqueue", "-c", str(config),
                    "exporter", "--port", str(exporter_port),
                    stdout=sink, stderr=sink, env=env,
                )  # fmt: skip
            await until_logged(exporter_log, "exporter serving the cluster's metrics", exporter)
            await completion(f"http://127.0.0.1:{gateway_port}")
            # The completion is folded and stored by the projector, then read
            # by each exporter (at most once a second): wait until both show it.
            folded = 'renqueue_backend_calls_total{backend="mock",outcome="completed"} 1.0'
            async with httpx.AsyncClient(timeout=10) as http, asyncio.timeout(30):
                while True:
                    by_up = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                    by_exporter = (await http.get(f"http://127.0.0.1:{exporter_port}/metrics")).text
                    if folded in by_up and folded in by_exporter:
                        break
                    await asyncio.sleep(0.2)  # polling the condition, with a deadline
        finally:
            if exporter is not None:
                assert await stop(exporter) == 0, exporter_log.read_text()[-3000:]
            assert await stop(up) == 0, up_log.read_text()[-3000:]
    assert_same(every, exported(by_up), "renqueue up --metrics-port")
    assert_same(sections["Cluster-wide series (the exporter)"], exported(by_exporter), "exporter")
    for text in (by_up, by_exporter):
        assert "renqueue_exporter_up 1.0" in text
        assert 'renqueue_backend_calls_total{backend="mock",outcome="completed"} 1.0' in text
        assert 'renqueue_level_waiting_requests{level="normal"} 0.0' in text


async def exporter_alone(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "renqueue", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "RENQUEUE_CONFIG": ""},
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_the_exporter_refuses_a_port_it_cannot_have_at_once() -> None:
    """In one line, exit 2, before it even looks for NATS (there is none here)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, err = await exporter_alone("--nats", "nats://127.0.0.1:1", "exporter", "--port", port)
    assert code == 2
    assert f"the exporter cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "Traceback" not in err


pytestmark = pytest.mark.timeout(120)
