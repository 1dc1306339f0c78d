"""A worker's active health probe of its backend (``[backends.<name>.probe]``).

For local servers, which can be asked whether they are up without spending a
call: ``GET <path>`` at the backend's origin (``/health`` for vLLM, TGI and
llama.cpp; ``/v1/models`` for any OpenAI-compatible server) every
``interval``; a 2xx within ``timeout`` is up, anything else (a status, a
refused connection, no answer in time) is down. Each time the answer changes
(and once at start) the worker logs a ``probed`` event
(``rq.evt._system.<backend>.probed``): the binder's circuit breaker opens on
a failed probe and closes on a probe that succeeds again, without waiting for
requests to fail or for its cool-off (:func:`renqueue.policy.next_circuit`).

The key, if the backend has one, is sent as for calls (``/v1/models`` asks
for it on a server started with ``--api-key``) and never appears in the event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httpx

from ...broker import EventLog
from ...config import BaseBackendConfig, ProbeConfig, parse_duration
from ...logs import get_logger
from ...schema import probed

__all__ = ["Prober", "probe_url"]

log = get_logger("worker")


def probe_url(config: BaseBackendConfig, probe: ProbeConfig) -> str:
    """The probe's URL: ``probe.path`` at the origin of the backend's ``base_url``."""
    return str(httpx.URL(config.base_url).copy_with(raw_path=probe.path.encode(), fragment=None))


class Prober:
    """Probes one backend for as long as :meth:`run` runs (a supervised loop)."""

    def __init__(
        self,
        backend: str,
        config: BaseBackendConfig,
        events: EventLog,
        *,
        worker: str,
        clock: Callable[[], float],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        assert config.probe is not None
        self._backend = backend
        self._probe = config.probe
        self._url = probe_url(config, config.probe)
        self._interval = parse_duration(config.probe.interval)
        self._timeout = parse_duration(config.probe.timeout)
        key = config.api_key(path=f"$.backends.{backend}")
        self._key = key.reveal() if key else ""
        # The key as the backend's own format carries it (Anthropic's
        # x-api-key, Gemini's x-goog-api-key, Bearer for the rest).
        self._headers = httpx.Headers(headers or {})
        self._events = events
        self._worker = worker
        self._clock = clock
        #: The answer last logged (``None``: none yet).
        self.last: bool | None = None

    async def run(self) -> None:
        """Probe every ``interval``; log each change of the answer (a failed log is tried again)."""
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            while True:
                ok, detail = await self.probe(client)
                if ok != self.last:
                    await self._events.append(
                        probed(
                            self._backend,
                            at=self._clock(),
                            ok=ok,
                            detail=detail,
                            worker=self._worker,
                        )
                    )
                    (log.info if ok else log.warning)(
                        "health probe answer changed", backend=self._backend, ok=ok, detail=detail
                    )
                    self.last = ok
                await asyncio.sleep(self._interval)

    async def probe(self, client: httpx.AsyncClient) -> tuple[bool, str]:
        """One probe: whether the backend answered 2xx in time, and what it said."""
        try:
            response = await client.get(self._url, headers=self._headers)
        except httpx.TimeoutException:
            return False, f"no answer within {self._timeout:g} s"
        except httpx.HTTPError as exc:
            return False, self._redact(f"{type(exc).__name__}: {exc}")[:300]
        if response.is_success:
            return True, f"HTTP {response.status_code}"
        if response.status_code in (301, 302, 307, 308, 404, 405):
            # The server answers, but not at this path: the probe is misconfigured,
            # and while it fails the backend's circuit stays open.
            log.error(
                "health probe path is wrong: the server answered but not there; "
                "the backend stays out of service until probe.path is fixed",
                backend=self._backend,
                path=self._probe.path,
                status=response.status_code,
            )
            return False, f"HTTP {response.status_code} (check probe.path)"
        return False, f"HTTP {response.status_code}"

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text
