"""End to end through the real services: a request routed to an Anthropic, Ollama,
TGI or Gemini backend completes, its tokens streamed to the client.

Each test runs Services (embedded nats-server on a free port, router, worker,
projector) and the mock backend on loopback, which speaks each provider's wire
format at its own path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from renqueue import Client, Services, parse_config
from renqueue.broker import EventLog
from renqueue.config import Config
from renqueue.mock import FaultSpec, MockBackend, MockSettings
from renqueue.schema import FellBack

KEY_ENV = "RQ_TEST_PIPELINE_KEY"


def config_for(tmp_path: Path, backends: dict[str, dict[str, Any]]) -> Config:
    return parse_config(
        {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {
                name: {"model": "mock", "api_key_env": KEY_ENV, **fields}
                for name, fields in backends.items()
            },
            "routes": {"chat": {"backends": list(backends)}},
            "worker": {"retry_delay": "100ms", "drain_timeout": "2s"},
            "router": {"capacity_refresh": "20ms"},
        }
    )


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-pipeline-key")


@pytest.mark.parametrize("adapter", ["anthropic", "ollama", "tgi", "gemini"])
async def test_a_request_routed_to_a_native_backend_completes(tmp_path: Path, adapter: str) -> None:
    settings = MockSettings(
        output_tokens=6, tokens_per_second=200, require_api_key="sk-pipeline-key"
    )
    async with MockBackend(settings) as mock:
        config = config_for(
            tmp_path, {"native": {"adapter": adapter, "base_url": mock.url_for(adapter)}}
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            handle = await client.submit("hello there", route="chat")
            chunks = [chunk async for chunk in handle.stream(timeout=10)]
            result = await handle.result(timeout=10)
        stats = mock.stats()
    assert result.text == "tok0 tok1 tok2 tok3 tok4 tok5"
    assert "".join(c.text for c in chunks) == result.text
    assert result.backend == "native"
    assert result.usage.completion_tokens == 6
    assert result.finish_reason == "stop"
    assert stats.requests == stats.completed == 1
    assert stats.last_request is not None


async def test_a_native_backends_failure_falls_back_by_its_class(tmp_path: Path) -> None:
    # Anthropic overloaded (529) on every call: the request falls back to Gemini.
    overloaded = MockSettings(faults=FaultSpec(script=("529",), repeat=True))
    async with (
        MockBackend(overloaded) as claude,
        MockBackend(MockSettings(output_tokens=3)) as gemini,
    ):
        config = config_for(
            tmp_path,
            {
                "claude": {"adapter": "anthropic", "base_url": claude.url_for("anthropic")},
                "gemini": {"adapter": "gemini", "base_url": gemini.url_for("gemini")},
            },
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            handle = await client.submit("hello", route="chat")
            result = await handle.result(timeout=15)
            events = await EventLog(client.js).history(client.tenant, handle.id)
    assert result.backend == "gemini"
    assert result.text == "tok0 tok1 tok2"
    assert [(e.backend, e.error_class) for e in events if isinstance(e, FellBack)] == [
        ("claude", "overloaded")
    ]
