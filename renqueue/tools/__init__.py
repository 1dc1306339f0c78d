"""Tools around Ren-Queue, not part of it: the mock LLM backend and the demo.

Needs the ``mock`` extra (aiohttp).

- :class:`MockBackend` (``_mockbackend``): a server on loopback speaking the
  OpenAI API and, at their own paths, Anthropic's, Ollama's, TGI's and Gemini's
  (``_mockdialects``), with declared limits and real 429s, for the demo, tests
  and benchmarks;
  :class:`FaultSpec` (``_mockfaults``) the faults it injects on demand.
- :func:`run_demo` (``_demo``): ``renqueue demo``.
"""

from ._demo import demo_config, run_demo
from ._mockbackend import (
    MockBackend,
    MockSettings,
    MockStats,
    format_reset,
    run_mock_backend,
    serve,
)
from ._mockfaults import FaultSpec

__all__ = [
    "FaultSpec",
    "MockBackend",
    "MockSettings",
    "MockStats",
    "demo_config",
    "format_reset",
    "run_demo",
    "run_mock_backend",
    "serve",
]
