"""The demo's live display of one streamed request: tokens, ``[restart]`` and its legend,
and the request's history, on a real pipeline whose backend fails the first call."""

from __future__ import annotations

from pathlib import Path

import pytest

from renqueue import Client, Services, parse_config
from renqueue.demo import _RESTART_LEGEND, _stream_live
from renqueue.mock import MockBackend, MockSettings


async def test_a_restarted_stream_is_marked_explained_once_and_its_history_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # failure_rate 0.5 with seed 1: the first call fails (HTTP 500), the second runs.
    settings = MockSettings(output_tokens=4, failure_rate=0.5, seed=1)
    async with MockBackend(settings) as mock:
        config = parse_config(
            {
                "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
                "backends": {"b1": {"base_url": mock.url, "model": "m"}},
                "routes": {"chat": {"backends": ["b1"]}},
                "worker": {"retry_delay": "50ms"},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant="t1") as client:
            first = await client.submit("hello", route="chat")
            printed_legend = await _stream_live(first, "normal chat", legend=True)
            again = await client.submit("hello again", route="chat")
            printed_again = await _stream_live(again, "normal chat", legend=True)
        assert (mock.stats().failed, mock.stats().completed) == (1, 2)
    out = capsys.readouterr().out
    assert printed_legend
    assert not printed_again  # the second stream did not restart
    lines = out.splitlines()
    assert lines[1] == "  [normal chat]  [restart] tok0 tok1 tok2 tok3"
    assert lines[2] == (
        "    ran on b1 -> call failed (backend_unavailable), retried -> ran on b1 -> completed"
    )
    assert "\n".join(lines[3:6]) == _RESTART_LEGEND
    assert lines[7] == "  [normal chat] tok0 tok1 tok2 tok3"
    assert lines[8] == "    ran on b1 -> completed"
    assert out.count("[restart] =") == 1
