"""What-if replay: a recorded workload run through the planner under another
config, in simulated time, on backend models fitted from the log
(``renqueue replay --what-if``; docs/what-if.md).

- The workload (``_trace``): :func:`trace_of` turns a stretch of the log into a
  :class:`Trace` (its :class:`Arrival` s with what really became of each,
  :class:`Recorded`; the backends' :class:`CallRecord` s and
  :class:`FailureRecord` s, :class:`Release` s of slots; the state at its start, the
  calls then :class:`Busy`); :func:`read_trace`
  (:mod:`renqueue.coordination`) reads one from NATS.
- Backend models (``_models``): :func:`fit_models` gives each backend a
  :class:`BackendModel` (recorded calls and failures, resampled), or one from
  a :class:`ModelSpec`.
- The simulation (``_simulator``): :func:`simulate`, a discrete-event
  simulation over :func:`renqueue.policy.plan` and the live fold, answering a
  :class:`Simulation` (each request's :class:`Outcome`, ``_outcomes``). Its
  parts share one world (``_world``: time, the requests, the projection): the
  router's intake (``_arrivals``), its rounds (``_rounds``; a round's views are
  built by :func:`backend_view`, ``_backends``, as the router builds its own)
  and the workers' runs (``_calls``). They follow the services' own rules
  (:mod:`renqueue.policy`) and build the services' own events
  (:mod:`renqueue.schema`), never copies of them.
- The report (``_report``, ``_whatif``): :func:`summarize` (a
  :class:`Summary`: cost, attainment per :class:`Level`, share per backend),
  :func:`recorded_outcomes`; :func:`compare` puts the recorded run and each
  simulation side by side (a :class:`Comparison` of :class:`Column` s),
  :func:`render` prints it; :func:`load_what_if` reads a what-if file
  (a :class:`WhatIfFile`).
"""

from ._backends import backend_view
from ._models import BackendModel, Drawn, ModelSpec, fit_models
from ._report import ENDINGS, Column, Level, Summary, recorded_outcomes, render, summarize
from ._simulator import HORIZON, MAX_ROUNDS, Outcome, Simulation, simulate
from ._trace import (
    UNFINISHED,
    WARMUP,
    Arrival,
    Busy,
    CallRecord,
    FailureRecord,
    Recorded,
    Release,
    Trace,
    trace_of,
)
from ._whatif import Comparison, WhatIfFile, compare, load_what_if

__all__ = [
    "ENDINGS",
    "HORIZON",
    "MAX_ROUNDS",
    "UNFINISHED",
    "WARMUP",
    "Arrival",
    "BackendModel",
    "Busy",
    "CallRecord",
    "Column",
    "Comparison",
    "Drawn",
    "FailureRecord",
    "Level",
    "ModelSpec",
    "Outcome",
    "Recorded",
    "Release",
    "Simulation",
    "Summary",
    "Trace",
    "WhatIfFile",
    "backend_view",
    "compare",
    "fit_models",
    "load_what_if",
    "recorded_outcomes",
    "render",
    "simulate",
    "summarize",
    "trace_of",
]
