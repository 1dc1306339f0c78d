"""Backend models fitted from the log: what a simulated call takes, and how it fails.

A :class:`BackendModel` holds a backend's recorded calls and failed runs
(:class:`~renqueue.sim.CallRecord`, :class:`~renqueue.sim.FailureRecord`) and
draws new ones from them by resampling (the empirical distribution, no
assumed shape):

- a completed call is one recorded call drawn whole, so its time to first
  token and token rate keep their joint spread, stretched to the simulated
  request's output: ``ttft + generating * (tokens - 1) / (recorded tokens - 1)``;
  plus the time from a routing decision to the call's start (dispatch, a
  worker taking it), drawn from the recorded ones;
- a run fails with the share of the backend's runs that failed for reasons of
  its own or its provider's (server errors, timeouts, broken streams, 429s;
  not the failures that were the request's doing, which are replayed per
  request); the failure is one recorded failure drawn whole (its class, its
  ``retry-after``, how long into the run it came);
- an output length, for a request whose real one is not known (it never
  completed), is a recorded call's;
- a slot is free for the next request a moment after a call ends (the worker
  acknowledging it, the router noticing, its next round): that moment is
  drawn from the recorded ones (:class:`~renqueue.sim.Release`), counted only
  where the backend was full under the config the log was recorded with
  (the time a slot took to be taken is then the router's, not a request's
  choice to wait).

A backend with no recorded call is modelled by a :class:`ModelSpec` when one is
given (``[whatif.models.<name>]`` in a what-if file), else by every backend's
calls pooled (``assumed``, said in the report).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Final

from msgspec import Meta, Struct

from ..errors import FailureClass, RenQueueError
from ._trace import CallRecord, FailureRecord, Trace

__all__ = ["BackendModel", "Drawn", "ModelSpec", "fit_models"]

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


class BackendModel(Struct, frozen=True, kw_only=True):
    """What a backend's calls take and how often they fail (module docstring)."""

    name: str
    calls: tuple[CallRecord, ...]
    failures: tuple[FailureRecord, ...] = ()
    #: Share of runs that fail (drawn from ``failures``).
    failure_p: float = 0.0
    overheads: tuple[float, ...] = ()
    releases: tuple[float, ...] = ()
    #: Modelled on every backend's calls: it has none of its own in the log.
    assumed: bool = False

    def draw(self, rng: random.Random, tokens: int) -> Drawn:
        """One run producing ``tokens`` output tokens, or its failure."""
        overhead = rng.choice(self.overheads) if self.overheads else 0.0
        release = rng.choice(self.releases) if self.releases else 0.0
        if self.failures and rng.random() < self.failure_p:
            return Drawn(overhead=overhead, failure=rng.choice(self.failures), release=release)
        call = rng.choice(self.calls)
        if call.tokens > 1:
            generating = call.generating * max(0, tokens - 1) / (call.tokens - 1)
        else:
            generating = call.generating
        return Drawn(overhead=overhead, ttft=call.ttft, generating=generating, release=release)

    def output(self, rng: random.Random) -> int:
        """An output length of a call of this backend's."""
        return rng.choice(self.calls).tokens


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
        name=name,
        calls=(CallRecord(backend=name, ttft=spec.ttft, generating=generating, tokens=tokens),),
        failures=(failure,) if spec.failure_rate > 0 else (),
        failure_p=spec.failure_rate,
        overheads=(spec.overhead,),
    )


def _fitted(
    name: str,
    calls: Sequence[CallRecord],
    failures: Sequence[FailureRecord],
    pooled: _Pooled,
    releases: Sequence[float],
    *,
    assumed: bool = False,
) -> BackendModel:
    own = tuple(call.overhead for call in calls if call.overhead is not None)
    runs = len(calls) + len(failures)
    return BackendModel(
        name=name,
        calls=tuple(calls),
        failures=tuple(failures),
        failure_p=len(failures) / runs if runs else 0.0,
        overheads=own if len(own) >= _OWN_SAMPLES else pooled.overheads,
        releases=tuple(releases) if len(releases) >= _OWN_SAMPLES else pooled.releases,
        assumed=assumed,
    )


class _Pooled(Struct, frozen=True):
    """Every backend's samples, for one with too few of its own."""

    overheads: tuple[float, ...]
    releases: tuple[float, ...]


def fit_models(
    trace: Trace,
    names: Iterable[str],
    given: Mapping[str, ModelSpec] | None = None,
    *,
    slots: Mapping[str, int] | None = None,
) -> dict[str, BackendModel]:
    """A model for each backend of ``names``: fitted from its calls in
    ``trace``, else ``given``'s, else every backend's calls pooled (``assumed``).

    ``slots``: each backend's concurrency when the log was recorded (the live
    config's), to tell a slot taken late because the router was busy from one
    left free (see the module docstring); ``None``: no release is modelled.

    Raises :class:`~renqueue.errors.RenQueueError` when a backend needs the
    pooled model and the trace has no completed call at all.
    """
    given = given or {}
    by_backend: dict[str, list[CallRecord]] = {}
    for call in trace.calls:
        by_backend.setdefault(call.backend, []).append(call)
    faults: dict[str, list[FailureRecord]] = {}
    for failure in trace.failures:
        faults.setdefault(failure.backend, []).append(failure)
    released: dict[str, list[float]] = {}
    for release in trace.releases:
        if slots is not None and release.busy >= slots.get(release.backend, 0) > 0:
            released.setdefault(release.backend, []).append(release.after)
    pooled = _Pooled(
        overheads=tuple(call.overhead for call in trace.calls if call.overhead is not None),
        releases=tuple(after for afters in released.values() for after in afters),
    )
    models: dict[str, BackendModel] = {}
    for name in names:
        calls = by_backend.get(name)
        own = released.get(name, ())
        if calls:
            models[name] = _fitted(name, calls, faults.get(name, ()), pooled, own)
        elif name in given:
            models[name] = _spec_model(name, given[name])
        elif trace.calls:
            models[name] = _fitted(name, trace.calls, trace.failures, pooled, own, assumed=True)
        else:
            raise RenQueueError(
                f"no call completed in the log between the window's warm-up and its end, so "
                f"there is nothing to model backend {name!r} on: give [whatif.models.{name}] "
                "in the what-if file, or choose a window with traffic"
            )
    return models
