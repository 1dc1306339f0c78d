"""Mock LLM backends for the demo, tests and benchmarks. I/O.

Needs the ``mock`` extra (aiohttp).

- :class:`MockBackend` (``_server``): a server on loopback speaking the
  OpenAI API and, at their own paths, Anthropic's, Ollama's, TGI's and
  Gemini's (``dialects``, one module per provider), configured by
  :class:`MockSettings` and counting in :class:`MockStats` (``_settings``);
- its declared limits, as token buckets (``_buckets``), with real 429s and
  rate-limit headers in a provider's style (``_rate_limits``);
- its answers, written at the configured pace (``_answers``);
- :class:`FaultSpec` (``_fault_injection``): the faults it injects on demand.
"""

from ._fault_injection import FaultSpec
from ._server import MockBackend, MockSettings, MockStats, format_reset, run_mock_backend, serve

__all__ = [
    "FaultSpec",
    "MockBackend",
    "MockSettings",
    "MockStats",
    "format_reset",
    "run_mock_backend",
    "serve",
]
