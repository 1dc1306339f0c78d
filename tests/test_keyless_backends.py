"""A backend taken out of service for a missing API key is shown as such: not
healthy in ``renqueue status`` (text and JSON) and down in the exporter's
``renqueue_backend_up``, never "closed" and healthy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from renqueue import Client, Services, parse_config
from renqueue.config import Config
from renqueue.coordination import (
    backend_status,
    cluster_families,
    read_cluster,
    read_status,
    render_status,
)
from renqueue.mock import MockBackend, MockSettings
from renqueue.state import BackendState

KEY = "RQ_TEST_KEYLESS_BACKEND_KEY"


def config_of(url: str, data_dir: Path) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(data_dir), "port": -1},
            "backends": {
                "cloud": {"base_url": url, "model": "m", "api_key_env": KEY},
                "local": {"base_url": url, "model": "m"},
            },
            "routes": {"chat": {"backends": ["cloud", "local"]}},
        }
    )


def up_of(families: list[Any], backend: str) -> float:
    (family,) = [f for f in families if f.name == "renqueue_backend_up"]
    (value,) = [s.value for s in family.samples if s.labels == {"backend": backend}]
    return float(value)


def test_a_keyless_backend_is_out_not_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY, raising=False)
    config = config_of("http://127.0.0.1:1/v1", Path("unused"))
    status = backend_status("cloud", BackendState(), config, 0.0, out="no API key: unset")
    assert not status.healthy
    assert status.circuit == "closed"  # the circuit is not what keeps it out
    document = msgspec.json.decode(msgspec.json.encode(status))
    assert document["healthy"] is False
    assert document["out"] == "no API key: unset"
    assert backend_status("local", BackendState(), config, 0.0).healthy


async def test_status_and_exporter_show_a_keyless_backend_out_of_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY, raising=False)
    async with MockBackend(MockSettings(output_tokens=2)) as mock:
        config = config_of(mock.url, tmp_path / "nats")
        async with Services(config) as services, Client(services.nc, tenant="t") as client:
            await (await client.submit("hi", route="chat")).result(timeout=10)
            # Read with the config as written, as `renqueue status -c` reads it.
            report = await read_status(services.js, config)
            reading = await read_cluster(services.js, config)
    by_name = {b.name: b for b in report.backends}
    cloud, local = by_name["cloud"], by_name["local"]
    assert not cloud.healthy
    assert cloud.out.startswith("no API key: ")
    assert f"environment variable {KEY} is not set" in cloud.out
    assert local.healthy
    assert local.out == ""

    document = msgspec.json.decode(msgspec.json.encode(report))
    cloud_json = next(b for b in document["backends"] if b["name"] == "cloud")
    assert cloud_json["healthy"] is False
    assert "no API key" in cloud_json["out"]

    text = "\n".join(render_status(report))
    rows = text.split("Backends\n")[1].split("\n\n")[0].splitlines()
    cloud_row = next(row for row in rows if row.split()[0] == "cloud")
    local_row = next(row for row in rows if row.split()[0] == "local")
    assert cloud_row.split()[1:4] == ["out:", "no", "API"]
    assert "closed" not in cloud_row
    assert local_row.split()[1] == "ok"
    assert f"  cloud: no API key: environment variable {KEY} is not set" in text

    # The exporter agrees, from the status alone (no `out` passed to it).
    families = cluster_families(reading, config, up=True, term=1)
    assert up_of(families, "cloud") == 0
    assert up_of(families, "local") == 1
