"""A real Prometheus (Debian's binary, on loopback, a data dir of its own)
scraping a running Ren-Queue under load, with deploy/prometheus/'s scrape jobs
and alert rules (a copy whose only change is shorter ``for:`` waits): its HTTP
API answers the key cluster series, every dashboard query, and an alert that
fires when a backend is taken down.

The cluster series come from ``renqueue exporter`` in a process of its own; the
per-process series from this process's registry, as ``--metrics-port`` serves
them. Everything is real: a nats-server, the services in this process, mock
backends on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import yaml
from _loopback import serve
from _prometheus import GRAFANA_DIR, PROMETHEUS_DIR, alert_rules, load_yaml, prometheus
from _waits import until
from aiohttp import web
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer
from renqueue.config import load_config
from renqueue.mock import MockBackend, MockSettings

#: How often the test's Prometheus scrapes and evaluates the rules.
INTERVAL = "500ms"
#: Every alert's ``for:`` in the test's copy of the rules.
FOR = "1s"
CIRCUIT_FAILURES = 2


def write_config(tmp_path: Path, nats_url: str, flaky: MockBackend, steady: MockBackend) -> Path:
    """Route ``chat`` over flaky then steady; flaky's circuit opens after two faults
    and stays open for the test."""
    file = tmp_path / "renqueue.toml"
    file.write_text(
        f'[nats]\nurl = "{nats_url}"\n'
        '[router]\ncapacity_refresh = "20ms"\n'
        '[worker]\nretry_delay = "50ms"\nmax_retry_delay = "100ms"\n'
        f'[backends.flaky]\nbase_url = "{flaky.url}"\nmodel = "m"\n'
        '[backends.flaky.limits]\nconcurrency = 4\nrequests = ["100000/day"]\n'
        f'[backends.flaky.circuit]\nfailures = {CIRCUIT_FAILURES}\ncooloff = "10m"\n'
        f'[backends.steady]\nbase_url = "{steady.url}"\nmodel = "m"\n'
        "[backends.steady.limits]\nconcurrency = 4\n"
        '[routes.chat]\nbackends = ["flaky", "steady"]\n'
        "[routes.chat.fallback]\nretries = 0\n"
    )
    return file


# --------------------------------------------------------------------- what is scraped


@contextlib.asynccontextmanager
async def exporter_process(config: Path, tmp_path: Path) -> AsyncIterator[str]:
    """``renqueue exporter`` on a free port; its ``host:port`` once it serves."""
    log = tmp_path / "exporter.log"
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "renqueue", "-c", str(config), "exporter", "--port", "0",
            stdout=sink, stderr=sink, env={**os.environ, "RENQUEUE_CONFIG": ""},
        )  # fmt: skip
    try:
        found: list[str] = []

        async def serving() -> bool:
            assert proc.returncode is None, log.read_text(errors="replace")
            found[:] = re.findall(r"http://(127\.0\.0\.1:\d+)/metrics", log.read_text())
            return bool(found)

        await until(serving, "renqueue exporter serves", within=30)
        yield found[0]
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


@contextlib.asynccontextmanager
async def process_metrics() -> AsyncIterator[str]:
    """This process's own series (renqueue/metrics.py), as `--metrics-port` serves them."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(
            body=prometheus_client.generate_latest(),
            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serve(app) as origin:
        yield origin.removeprefix("http://")


# -------------------------------------------------------------- the test's Prometheus


def prometheus_config(tmp_path: Path, exporter: str, processes: str) -> Path:
    """deploy/prometheus/'s config and rules, for the test: its jobs pointed at
    the test's targets (the gateway's dropped: none runs here), scraped and
    evaluated every INTERVAL, and each alert's ``for:`` shortened to FOR."""
    rules = load_yaml(PROMETHEUS_DIR / "rules.yml")
    for rule in alert_rules(rules):
        rule["for"] = FOR
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    config["global"].update(scrape_interval=INTERVAL, evaluation_interval=INTERVAL)
    targets = {"renqueue-exporter": [exporter], "renqueue-processes": [processes]}
    config["scrape_configs"] = [
        {**job, "static_configs": [{"targets": targets[job["job_name"]]}]}
        for job in config["scrape_configs"]
        if job["job_name"] in targets
    ]
    file = tmp_path / "prometheus.yml"
    file.write_text(yaml.safe_dump(config, sort_keys=False))
    return file


class PrometheusApi:
    """Prometheus's HTTP API, as a dashboard or an operator reads it."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def query(self, promql: str) -> list[dict[str, Any]]:
        answer = (await self.http.get("/api/v1/query", params={"query": promql})).json()
        assert answer["status"] == "success", (promql, answer)
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    async def values(self, promql: str, label: str) -> dict[str, float]:
        """Each sample's ``label`` and value."""
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in await self.query(promql)}

    async def alerts(self, state: str) -> list[dict[str, Any]]:
        answer = (await self.http.get("/api/v1/alerts")).json()
        assert answer["status"] == "success", answer
        return [a for a in answer["data"]["alerts"] if a["state"] == state]

    async def last_evaluation(self) -> float:
        """When the alert rules were last evaluated (Unix seconds)."""
        answer = (await self.http.get("/api/v1/rules", params={"type": "alert"})).json()
        [group] = answer["data"]["groups"]
        stamp = re.sub(r"(\.\d{6})\d+", r"\1", group["lastEvaluation"]).replace("Z", "+00:00")
        return datetime.datetime.fromisoformat(stamp).timestamp()


@contextlib.asynccontextmanager
async def load(client: Client, *, workers: int = 4) -> AsyncIterator[list[int]]:
    """Requests on route chat, ``workers`` at a time, for the block; the count
    completed. On leaving, each worker finishes its request in hand and stops."""
    completed = [0]
    stop = asyncio.Event()

    async def submit_until_stopped(n: int) -> None:
        k = 0
        while not stop.is_set():
            handle = await client.submit(f"load {n}-{k}", route="chat", timeout=60)
            await handle.result(timeout=60)
            completed[0] += 1
            k += 1

    tasks = [asyncio.create_task(submit_until_stopped(n)) for n in range(workers)]
    try:
        yield completed
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=60)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert not pending, "a request under load did not end within 60 s"
        failures = [task.exception() for task in done if task.exception() is not None]
        assert not failures, f"a request under load did not complete: {failures[0]!r}"


def dashboard_queries() -> list[str]:
    board = load_yaml(GRAFANA_DIR / "dashboards" / "renqueue.json")  # JSON is YAML
    exprs = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    return [e.replace("$__rate_interval", "5s") for e in exprs]


async def test_prometheus_scrapes_the_cluster_and_fires_an_alert_when_a_backend_goes_down(
    isolated_server: EmbeddedServer, tmp_path: Path
) -> None:
    settings = MockSettings(ttft=0.01, output_tokens=3)
    async with MockBackend(settings) as flaky, MockBackend(settings) as steady:
        file = write_config(tmp_path, isolated_server.url, flaky, steady)
        config = load_config(file, environ={})
        async with (
            Services(config) as services,
            Client(services.nc, tenant=TENANT) as client,
            exporter_process(file, tmp_path) as exporter,
            process_metrics() as processes,
            prometheus(prometheus_config(tmp_path, exporter, processes), tmp_path / "tsdb") as url,
            httpx.AsyncClient(base_url=url, timeout=5) as http,
            load(client) as completed,
        ):
            api = PrometheusApi(http)

            # The key series, scraped from the running cluster under load.
            async def both_scraped() -> bool:
                up = await api.values("up", "job")
                return up == {"renqueue-exporter": 1, "renqueue-processes": 1}

            await until(both_scraped, "Prometheus scraped the exporter and the process")

            async def calls_counted() -> bool:
                calls = await api.values(
                    'renqueue_backend_calls_total{job="renqueue-exporter",outcome="completed"} > 0',
                    "backend",
                )
                return "flaky" in calls

            await until(calls_counted, "Prometheus has the cluster's completed calls", within=30)
            levels = await api.values("renqueue_level_waiting_requests", "level")
            assert set(levels) == set(config.priorities)
            assert await api.values("renqueue_backend_up", "backend") == {"flaky": 1, "steady": 1}
            closed = await api.values('renqueue_backend_circuit_state{state="closed"}', "backend")
            assert closed == {"flaky": 1, "steady": 1}
            assert await api.values("renqueue_backend_slots_limit", "backend") == {
                "flaky": 4,
                "steady": 4,
            }
            quota = await api.values('renqueue_backend_quota_limit{unit="requests"}', "backend")
            assert quota == {"flaky": 100000}
            assert await api.values("renqueue_dlq_messages", "") == {"": 0}
            assert await api.query("renqueue_projection_lag_events")
            assert await api.values("renqueue_exporter_up", "") == {"": 1}
            assert await api.values("renqueue_binder_present", "") == {"": 1}
            # The histograms, from completed events in the log whichever process ran them.
            ttft = await api.values("renqueue_backend_ttft_seconds_count > 0", "backend")
            assert "flaky" in ttft
            # This process's own series, from the per-process job.
            routed = await api.values('sum by (job) (renqueue_routed_total{job!=""})', "job")
            assert routed.get("renqueue-processes", 0) > 0
            # Every query of the dashboard runs on what Prometheus holds.
            for expr in dashboard_queries():
                await api.query(expr)

            # Healthy: once the rules have been evaluated on these samples, no circuit alert.
            healthy_at = time.time()

            async def evaluated_since_healthy() -> bool:
                return await api.last_evaluation() > healthy_at

            await until(evaluated_since_healthy, "the alert rules were evaluated again")
            firing = await api.alerts("firing") + await api.alerts("pending")
            assert [a for a in firing if a["labels"]["alertname"] == "BackendCircuitOpen"] == []

            # Take flaky down: its calls fail, its circuit opens, the alert fires for it.
            flaky.update(down=True)

            async def circuit_alert_fires() -> bool:
                return any(
                    a["labels"]["alertname"] == "BackendCircuitOpen"
                    for a in await api.alerts("firing")
                )

            await until(circuit_alert_fires, "BackendCircuitOpen fired", within=30)
            [alert] = [
                a
                for a in await api.alerts("firing")
                if a["labels"]["alertname"] == "BackendCircuitOpen"
            ]
            assert alert["labels"]["backend"] == "flaky"
            assert alert["labels"]["severity"] == "warning"
            assert alert["annotations"]["summary"] == (
                "Backend flaky: circuit open, requests go elsewhere"
            )
            assert await api.values("renqueue_backend_up", "backend") == {"flaky": 0, "steady": 1}
            faults = await api.values("renqueue_backend_faults_total", "backend")
            assert faults["flaky"] >= CIRCUIT_FAILURES
            assert faults.get("steady", 0) == 0
            # Requests go on completing on steady meanwhile.
            before = completed[0]

            async def still_served() -> bool:
                return completed[0] >= before + 5

            await until(still_served, "requests completed on steady with flaky down")
