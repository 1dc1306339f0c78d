"""The whole stack in one command: docker-compose.yml, and ``make stack`` (deploy/stack.py).

There is no Docker daemon in the test environment, so compose's file is checked by the
compose tool itself (``docker compose config``, or Debian's ``docker-compose config``:
``make compose-tool`` installs it), and the services it declares are run as processes by
deploy/stack.py, the program behind ``make stack``: three clustered nats-server nodes,
the mock backends, a router, two workers, the gateway (and the exporter and Prometheus
where this checkout has them), on free ports. A request through the gateway must be
answered, and Ctrl-C must stop every process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
OPERATIONS = ROOT / "docs" / "operations.md"


def compose_command() -> list[str]:
    """``docker compose`` if the plugin is there, else Debian's ``docker-compose``."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False, timeout=30
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is None:
        pytest.fail("neither `docker compose` nor `docker-compose` is installed: make compose-tool")
    return [legacy]


def test_docker_compose_config_accepts_the_compose_file() -> None:
    run = subprocess.run(
        [*compose_command(), "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr


def test_compose_runs_the_whole_stack_on_the_committed_config() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {
        "nats-1", "nats-2", "nats-3", "router", "worker", "gateway", "exporter",
        "mock-local", "mock-free", "mock-paid", "prometheus", "grafana",
    } <= set(services)  # fmt: skip
    for name in ("router", "worker", "gateway", "exporter", "mock-local"):
        assert services[name]["build"] == "."
        assert "./deploy/renqueue.toml:/etc/renqueue/renqueue.toml:ro" in services[name]["volumes"]
    # Scaled services must hold no port of their own (host networking).
    for name in ("router", "worker"):
        assert not any("port" in arg for arg in services[name]["command"])
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana
    assert "./deploy/grafana/dashboards:/etc/grafana/dashboards/renqueue:ro" in grafana
    # The mocks listen where deploy/renqueue.toml's backends call them.
    config = (ROOT / "deploy" / "renqueue.toml").read_text()
    for name in ("mock-local", "mock-free", "mock-paid"):
        port = services[name]["command"][services[name]["command"].index("--port") + 1]
        assert f"http://127.0.0.1:{port}/v1" in config


def test_every_file_compose_mounts_is_in_the_checkout() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    missing = [
        f"{name}: {volume}"
        for name, service in services.items()
        for volume in service.get("volumes", [])
        if volume.startswith(".") and not (ROOT / volume.split(":")[0]).exists()
    ]
    if missing and all("deploy/prometheus" in m or "deploy/grafana" in m for m in missing):
        pytest.skip(f"Prometheus's and Grafana's files are not in this checkout yet: {missing}")
    assert not missing


# ------------------------------------------------------------------------- make stack


def has_command(name: str) -> bool:
    """Whether this checkout's ``renqueue`` has the subcommand ``name``."""
    run = subprocess.run(
        [sys.executable, "-m", "renqueue", name, "--help"],
        capture_output=True,
        check=False,
        timeout=60,
    )
    return run.returncode == 0


async def start_stack(workdir: Path, *args: str) -> tuple[asyncio.subprocess.Process, Any]:
    """deploy/stack.py on free ports; the process and its ``stack ready`` report."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "deploy" / "stack.py"), "--free-ports",
        "--workdir", str(workdir), *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")},
    )  # fmt: skip
    assert proc.stdout is not None
    said: list[str] = []
    while True:
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail("the stack was not ready within 90 s:\n" + "".join(said))
        if not line:
            await proc.wait()
            pytest.fail(f"the stack exited ({proc.returncode}):\n" + "".join(said))
        said.append(line)
        if line.startswith("stack ready "):
            return proc, json.loads(line.removeprefix("stack ready "))


def doc_command(start: str, *, port: str = "8080", config: Path | None = None) -> str:
    """The command of docs/operations.md that begins with ``start``, for this stack."""
    lines = [line.strip() for line in OPERATIONS.read_text().splitlines() if start in line.strip()]
    assert lines, f"docs/operations.md shows no command starting {start!r}"
    command = lines[0].removeprefix("- ").strip("`").split("`")[0]
    command = command.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    if config is not None:
        command = command.replace("deploy/renqueue.toml", str(config))
    return command


async def shell(command: str) -> str:
    """Run ``command`` with sh; its stdout (the test fails on a non-zero exit)."""
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"{command}\n{err.decode()}"
    return out.decode()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_make_stack_answers_through_the_gateway_and_ctrl_c_stops_every_process(
    tmp_path: Path,
) -> None:
    skip = [] if has_command("exporter") else ["--skip", "exporter"]
    proc, ready = await start_stack(tmp_path, "--scale", "worker=2", *skip)
    try:
        pids = ready["pids"]
        expected = {"nats-1", "nats-2", "nats-3", "router", "worker-1", "worker-2", "gateway"}
        assert expected <= set(pids)
        # The docs' own commands, with the stack's ports and config in.
        port = str(ready["ports"]["8080"])
        body = json.loads(await shell(doc_command("curl -s http://127.0.0.1:8080", port=port)))
        assert "choices" in body, body
        assert body["choices"][0]["message"]["content"].startswith("tok0")
        assert body["usage"]["completion_tokens"] > 0
        config = Path(ready["workdir"]) / "mounts" / "router" / "deploy" / "renqueue.toml"
        status = await shell(f"{sys.executable} -m " + doc_command("renqueue -c", config=config))
        assert "local" in status
        assert "paid" in status
        async with httpx.AsyncClient(timeout=30) as http:
            if "exporter" in pids:
                metrics = await http.get(f"http://127.0.0.1:{ready['ports']['9464']}/metrics")
                assert "renqueue_binder_term" in metrics.text
            if "prometheus" in pids:
                prometheus = f"http://127.0.0.1:{ready['ports']['9090']}"
                assert (await http.get(f"{prometheus}/-/ready")).status_code == 200
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = await asyncio.wait_for(proc.wait(), 60)
    assert code == 0
    assert [name for name, pid in pids.items() if alive(pid)] == []


def load_stack_module() -> Any:
    spec = importlib.util.spec_from_file_location("renqueue_stack", ROOT / "deploy" / "stack.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_make_stack_runs_each_compose_service_with_its_command_and_moved_ports(
    tmp_path: Path,
) -> None:
    stack = load_stack_module()
    ports = stack.Ports(free=True)
    plan = stack.plan(
        yaml.safe_load(COMPOSE.read_text()),
        compose_dir=ROOT,
        workdir=tmp_path,
        ports=ports,
        scale={"worker": 3},
        skip={"prometheus"},
    )
    ports.release()
    by_name = {process.name: process for process in plan.processes}
    assert {"worker-1", "worker-2", "worker-3"} <= set(by_name)
    assert plan.left_out["prometheus"] == "--skip"
    assert "runs only in its container" in plan.left_out["grafana"]
    # A Ren-Queue service: `python -m renqueue` and its command, its config a copy with
    # every port moved (the mocks', the NATS nodes', the gateway's) the same way.
    gateway = by_name["gateway"]
    assert gateway.argv[1:] == ["-m", "renqueue", "gateway"]
    config = Path(gateway.env["RENQUEUE_CONFIG"])
    assert config.is_relative_to(tmp_path)
    text = config.read_text()
    assert f"port = {ports.moved[8080]}" in text
    assert f"nats://127.0.0.1:{ports.moved[4222]}" in text
    mock = by_name["mock-local"]
    assert mock.argv[mock.argv.index("--port") + 1] == str(ports.moved[9101])
    assert f"http://127.0.0.1:{ports.moved[9101]}/v1" in text
    # A NATS node: the wheel's nats-server on its config (ports moved), in its data volume.
    node = by_name["nats-2"]
    assert Path(node.argv[0]).name == "nats-server"
    node_config = Path(node.argv[-1]).read_text()
    assert f"port: {ports.moved[4223]}" in node_config
    assert f"listen: 127.0.0.1:{ports.moved[6223]}" in node_config
    assert f"nats-route://127.0.0.1:{ports.moved[6224]}" in node_config
    assert node.cwd == tmp_path / "volumes" / "nats-2-data"
    assert len(set(ports.moved.values())) == len(ports.moved)
