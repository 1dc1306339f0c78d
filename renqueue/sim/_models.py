"""Backend models fitted from the log: what a simulated call takes, and how it fails.

A :class:`BackendModel` holds a backend's recorded runs, completed
(:class:`~renqueue.sim.CallRecord`) and failed (:class:`~renqueue.sim.FailureRecord`),
in time order, and draws new ones by resampling them (their empirical
distribution, no assumed shape) **near the simulated moment**: a run starting
at ``t`` is one of the :data:`NEIGHBOURS` recorded runs that started nearest
to ``t``, drawn whole. So a backend that slowed down or failed for a while in
the log does so at the same time in the simulation, and a busy machine's
slower moments stay where they were:

- a completed call keeps its time to first token and token rate together,
  stretched to the simulated request's output:
  ``ttft + generating * (tokens - 1) / (recorded tokens - 1)``;
- a failed run keeps its class, its ``retry-after`` and how long into the
  run it came; the share of failures among the neighbours is the failure
  rate there and then (backend faults and 429s; not the failures that were
  the request's own doing, which are replayed per request);
- the time from a routing decision to the call's start (dispatch, a worker
  taking it) is drawn the same way from the recorded ones;
- so is the moment a slot is free for the next request after a call ends
  (the worker acknowledging it, the router noticing, its next round), from
  the recorded ones (:class:`~renqueue.sim.Release`) counted only where the
  backend was full under the config the log was recorded with (then the
  time a slot took to be taken is the services', not a request's choice to
  wait);
- an output length, for a request whose real one is not known (it never
  completed), is one of the neighbouring calls'.

A backend with no recorded call is modelled by a :class:`ModelSpec` when one is
given (``[whatif.models.<name>]`` in a what-if file), else by every backend's
runs pooled (``assumed``, said in the report).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Final

from msgspec import Meta, Struct

from ..errors import FailureClass, RenQueueError
from ..policy import DEFAULT_MAX_TOKENS
from ._trace import CallRecord, FailureRecord, Trace

__all__ = ["NEIGHBOURS", "BackendModel", "Drawn", "ModelSpec", "fit_models"]

#: Recorded runs (and overheads, releases) a draw chooses among: those nearest
#: in time to the simulated moment.
NEIGHBOURS: Final = 25
#: Samples (overheads, releases) a backend needs before its own are drawn
#: (else every backend's, pooled).
_OWN_SAMPLES: Final = 5


class ModelSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A backend's model given by hand, for one the log has no calls of
    (``[whatif.models.<name>]``): fixed times, no spread."""

    #: Seconds to the first token.
    ttft: Annotated[float, Meta(ge=0, le=86_400)] = 0.5
    #: Output tokens per second after the first (0: all at once).
    tokens_per_second: Annotated[float, Meta(ge=0, le=1_000_000)] = 50.0
    #: Output tokens of a request whose real output is not known.
    output_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 256
    #: Share of runs that fail (a server error, retried or fallen back from).
    failure_rate: Annotated[float, Meta(ge=0, le=1)] = 0.0
    #: Seconds from a routing decision to the call's start.
    overhead: Annotated[float, Meta(ge=0, le=3600)] = 0.0


class Drawn(Struct, frozen=True, kw_only=True):
    """One simulated run: its overhead, time to first token and the time after
    it, or the failure it ends in (after ``failure.after`` seconds)."""

    overhead: float
    ttft: float = 0.0
    generating: float = 0.0
    failure: FailureRecord | None = None
    #: Seconds the slot stays taken after the run leaves the backend.
    release: float = 0.0

    @property
    def duration(self) -> float:
        """The call's own duration (what a ``completed`` event records)."""
        return self.ttft + self.generating


class _Samples:
    """Values with the times they were recorded at, drawn near a moment."""

    __slots__ = ("times", "values")

    def __init__(self, samples: Iterable[tuple[float, float]]) -> None:
        ordered = sorted(samples)
        self.times = [at for at, _ in ordered]
        self.values = [value for _, value in ordered]

    def __len__(self) -> int:
        return len(self.values)

    def draw(self, rng: random.Random, at: float) -> float:
        if not self.values:
            return 0.0
        return self.values[_near(self.times, at, rng)]


def _near(times: Sequence[float], at: float, rng: random.Random) -> int:
    """The index of one of the :data:`NEIGHBOURS` entries of ``times`` (sorted)
    nearest to ``at``, at random."""
    count = len(times)
    if count <= NEIGHBOURS:
        return rng.randrange(count)
    middle = bisect.bisect_left(times, at)
    first = min(max(0, middle - NEIGHBOURS // 2), count - NEIGHBOURS)
    return first + rng.randrange(NEIGHBOURS)


class BackendModel:
    """What a backend's calls take and how often they fail (module docstring).

    ``failure_p``, when given, fixes the failure rate (a :class:`ModelSpec`'s);
    otherwise it is the share of failures among the runs drawn from.
    """

    def __init__(
        self,
        name: str,
        *,
        calls: Sequence[CallRecord] = (),
        failures: Sequence[FailureRecord] = (),
        overheads: Iterable[tuple[float, float]] = (),
        releases: Iterable[tuple[float, float]] = (),
        failure_p: float | None = None,
        assumed: bool = False,
    ) -> None:
        self.name = name
        #: Modelled on every backend's runs: it has none of its own in the log.
        self.assumed = assumed
        self.failure_p = failure_p
        runs: list[CallRecord | FailureRecord] = [*calls, *failures]
        runs.sort(key=lambda run: run.at)
        self.runs = runs
        self.run_times = [run.at for run in runs]
        self.calls = sorted(calls, key=lambda call: call.at)
        self.call_times = [call.at for call in self.calls]
        self.failures = tuple(failures)
        self.overheads = _Samples(overheads)
        self.releases = _Samples(releases)

    def draw(self, rng: random.Random, tokens: int, at: float) -> Drawn:
        """One run starting at ``at`` and producing ``tokens`` output tokens, or its failure."""
        overhead = self.overheads.draw(rng, at)
        release = self.releases.draw(rng, at)
        if self.failure_p is not None:
            if self.failures and rng.random() < self.failure_p:
                return Drawn(overhead=overhead, failure=rng.choice(self.failures), release=release)
            run: CallRecord | FailureRecord = self.calls[_near(self.call_times, at, rng)]
        else:
            run = self.runs[_near(self.run_times, at, rng)]
        if isinstance(run, FailureRecord):
            return Drawn(overhead=overhead, failure=run, release=release)
        if run.tokens > 1:
            generating = run.generating * max(0, tokens - 1) / (run.tokens - 1)
        else:
            generating = run.generating
        return Drawn(overhead=overhead, ttft=run.ttft, generating=generating, release=release)

    def output(self, rng: random.Random, at: float) -> int:
        """An output length of a call of this backend's near ``at``."""
        if not self.calls:
            return DEFAULT_MAX_TOKENS
        return self.calls[_near(self.call_times, at, rng)].tokens


def _spec_model(name: str, spec: ModelSpec) -> BackendModel:
    tokens = spec.output_tokens
    generating = 0.0 if spec.tokens_per_second <= 0 else (tokens - 1) / spec.tokens_per_second
    failure = FailureRecord(
        backend=name,
        error_type="backend_unavailable",
        error_class=FailureClass.SERVER_ERROR.value,
        after=spec.ttft,
    )
    return BackendModel(
        name,
        calls=(CallRecord(backend=name, ttft=spec.ttft, generating=generating, tokens=tokens),),
        failures=(failure,),
        failure_p=spec.failure_rate,
        overheads=((0.0, spec.overhead),),
    )


def fit_models(
    trace: Trace,
    names: Iterable[str],
    given: Mapping[str, ModelSpec] | None = None,
    *,
    slots: Mapping[str, int] | None = None,
) -> dict[str, BackendModel]:
    """A model for each backend of ``names``: fitted from its runs in
    ``trace``, else ``given``'s, else every backend's runs pooled (``assumed``).

    ``slots``: each backend's concurrency when the log was recorded (the live
    config's), to tell a slot taken late because the services were busy from
    one left free (see the module docstring); ``None``: no release is modelled.

    Raises :class:`~renqueue.errors.RenQueueError` when a backend needs the
    pooled model and the trace has no completed call at all.
    """
    given = given or {}
    calls: dict[str, list[CallRecord]] = {}
    for call in trace.calls:
        calls.setdefault(call.backend, []).append(call)
    failures: dict[str, list[FailureRecord]] = {}
    for failure in trace.failures:
        failures.setdefault(failure.backend, []).append(failure)
    overheads: dict[str, list[tuple[float, float]]] = {}
    for call in trace.calls:
        if call.overhead is not None:
            overheads.setdefault(call.backend, []).append((call.at, call.overhead))
    releases: dict[str, list[tuple[float, float]]] = {}
    for release in trace.releases:
        if slots is not None and release.busy >= slots.get(release.backend, 0) > 0:
            releases.setdefault(release.backend, []).append((release.at, release.after))
    every_overhead = [sample for samples in overheads.values() for sample in samples]
    every_release = [sample for samples in releases.values() for sample in samples]

    def own(samples: dict[str, list[tuple[float, float]]], name: str) -> list[tuple[float, float]]:
        mine = samples.get(name, [])
        if len(mine) >= _OWN_SAMPLES:
            return mine
        return every_overhead if samples is overheads else every_release

    models: dict[str, BackendModel] = {}
    for name in names:
        if name in calls:
            models[name] = BackendModel(
                name,
                calls=calls[name],
                failures=failures.get(name, ()),
                overheads=own(overheads, name),
                releases=own(releases, name),
            )
        elif name in given:
            models[name] = _spec_model(name, given[name])
        elif trace.calls:
            models[name] = BackendModel(
                name,
                calls=trace.calls,
                failures=trace.failures,
                overheads=every_overhead,
                releases=every_release,
                assumed=True,
            )
        else:
            raise RenQueueError(
                f"no call completed in the log between the window's warm-up and its end, so "
                f"there is nothing to model backend {name!r} on: give [whatif.models.{name}] "
                "in the what-if file, or choose a window with traffic"
            )
    return models
