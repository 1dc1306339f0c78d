"""How long a request would take on a backend, and what it would cost: the
numbers "cheapest in time" is decided by.

A backend's speed is learned from its own completed calls in the log
(:class:`Perf`, folded by :func:`learn_call`, :func:`learn_fault`): time to
first token, output tokens per second after it, and output length, each as a
moving average with its spread (exponentially weighted variance, the newest
call weighing :data:`WEIGHT`), and how often a call fails for the backend's
own fault or a 429. :func:`predict` turns that, a backend's load and quota and
one request into a :class:`Prediction`: when the call could start, when it
would finish, and what it would cost.

The finish time is a deliberately cautious one: the means plus ``spread``
standard deviations (1 by default: about the 84th percentile of a normal
spread), an output as long as ``max_tokens`` when the request sets one, and
the expected time lost to a failed try (fault and 429 probability times the
service time). A backend with fewer than ``min_samples`` completions has no
model yet: its prediction falls back to the mean call duration when one is
known, and is otherwise unknown (``finish is None``), which is never judged
late: a backend must be tried to be learned.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Final

from msgspec import Struct

from ..wire._messages import InferenceRequest
from ._perf import MIN_SAMPLES, Perf
from ._quota import Cost, Quota, QuotaVerdict, check
from ._routing import BackendView, NoRoom, capable, choose, estimated_cost
from ._tokens import DEFAULT_MAX_TOKENS

#: A token rate is never taken below this share of its mean, however wide its
#: spread (a rate near 0 would predict an endless call).
_RATE_FLOOR: Final = 0.25
#: Below this many tokens per second a learned rate is no model (only a
#: broken or forged view could hold one).
_MIN_RATE: Final = 1e-3

_NO_SPEND: Final = Quota()


class Prediction(Struct, frozen=True, kw_only=True):
    """What binding one request to one backend is expected to bring."""

    backend: str
    #: When the call could start: now, or when a slot or its quota frees.
    start: float
    #: When it would finish (cautious: see the module docstring); ``None``: no model yet.
    finish: float | None
    #: Estimated US dollars (:func:`~renqueue.policy.estimated_cost`).
    cost: float
    #: Why it cannot start now: ``""`` if it can.
    held: str = ""
    #: The mean service time (no spread, no wait): what an early "hopeless"
    #: verdict is judged by; ``None``: no model yet.
    mean_service: float | None = None

    @property
    def now(self) -> bool:
        """It can start at once."""
        return not self.held


def output_tokens(request: InferenceRequest, perf: Perf | None, spread: float) -> float:
    """The output to plan for: ``max_tokens`` when the request sets it (the
    most it may generate), else the backend's learned length plus ``spread``
    deviations, else :data:`DEFAULT_MAX_TOKENS`."""
    if request.params.max_tokens is not None:
        return float(request.params.max_tokens)
    if perf is not None and perf.samples >= MIN_SAMPLES:
        return perf.output + spread * perf.output_sd
    return float(DEFAULT_MAX_TOKENS)


def service_time(
    request: InferenceRequest,
    view: BackendView,
    *,
    spread: float,
    min_samples: int = MIN_SAMPLES,
) -> float | None:
    """Seconds a call of ``request`` at ``view`` is expected to take once it
    starts, ``spread`` deviations cautious (0: the means); ``None``: not known."""
    perf = view.perf
    if perf is None or perf.samples < min_samples or not perf.rate >= _MIN_RATE:
        return view.expected_duration
    ttft = perf.ttft + spread * perf.ttft_sd
    rate = max(perf.rate - spread * perf.rate_sd, perf.rate * _RATE_FLOOR)
    tokens = output_tokens(request, perf, spread) if spread > 0 else _mean_output(request, perf)
    # A try that fails is time lost before the next: its expected share.
    retry = min(0.9, perf.fault_p + perf.limited_p) if spread > 0 else 0.0
    return (ttft + max(0.0, tokens - 1) / rate) * (1 + retry)


def _mean_output(request: InferenceRequest, perf: Perf) -> float:
    """The output a hopeless verdict assumes: the mean length, capped by ``max_tokens``."""
    if request.params.max_tokens is not None:
        return min(float(request.params.max_tokens), perf.output)
    return perf.output


def predict(
    request: InferenceRequest,
    view: BackendView,
    now: float,
    *,
    cost: Cost,
    spread: float = 1.0,
    min_samples: int = MIN_SAMPLES,
) -> Prediction:
    """When ``request`` would finish on ``view`` (see the module docstring) and
    what it would cost, if bound now or as soon as the backend has room.

    A backend with a free slot and room in its quota starts it now. One whose
    quota is short starts when the quota says (its verdict's ``until``); one
    whose slots are all taken starts when enough calls ahead of it end: each
    of the ``in_flight - capacity + 1 + waiting`` calls ahead takes its mean
    duration over ``capacity`` slots (unknown without a model: then the start
    is unknown too, and so is the finish).
    """
    service = service_time(request, view, spread=spread, min_samples=min_samples)
    mean = service_time(request, view, spread=0.0, min_samples=min_samples)
    start = now
    held = ""
    if view.limits or view.quota is not None:
        verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
        if not verdict.ok:
            start = max(start, verdict.until)
            held = verdict.reason
    if view.free <= 0:
        ahead = max(0, view.in_flight - view.capacity) + 1 + view.queued
        slot = None if mean is None or view.capacity <= 0 else ahead * mean / view.capacity
        start = math.inf if slot is None else max(start, now + slot)
        held = held or "every slot taken"
    finish = None if service is None or math.isinf(start) else start + service
    return Prediction(
        backend=view.name,
        start=start,
        finish=finish,
        cost=estimated_cost(request, view),
        held=held,
        mean_service=mean,
    )


class RouteRules(Struct, frozen=True, kw_only=True):
    """How a route's candidates are chosen among (``[routes.<name>]``:
    ``strategy``, ``adapt``, ``explore``, ``spread``)."""

    #: ``"cheapest"``: the cheapest candidate predicted to finish in time
    #: (:func:`choose_in_time`); ``"cascade"``: the first with room, in order.
    strategy: str = "cheapest"
    #: Among candidates of the same cost that are in time, prefer the one
    #: predicted to finish first (off: the cascade's order decides).
    adapt: bool = False
    #: With ``adapt``, the share of requests (0-1) that choose among those by a
    #: draw from each one's predicted spread (Thompson sampling), so that the
    #: estimates of the ones not chosen stay fresh.
    explore: float = 0.0
    #: Standard deviations of caution in a predicted finish (:func:`predict`).
    spread: float = 1.0


CASCADE: Final = RouteRules(strategy="cascade")


class Pick(Struct, frozen=True, kw_only=True):
    """What :func:`choose_in_time` answers: bind to ``backend`` now, or (a
    :class:`~renqueue.policy.NoRoom`) not now; in that case ``wait_for`` may
    name the cheaper candidate worth waiting for. ``passed``: the candidates
    with a free slot passed over for their quota, as :func:`choose` reports
    them. ``reason``: why, for the event (empty: the cascade's first with room)."""

    backend: str | NoRoom
    passed: list[tuple[str, QuotaVerdict]]
    wait_for: str | None = None
    #: When the one waited for is predicted to take it.
    wait_start: float = 0.0
    reason: str = ""
    #: The prediction of the one bound or waited for (``None``: the cascade's choice).
    prediction: Prediction | None = None


def choose_in_time(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    cost: Cost,
    now: float,
    *,
    rules: RouteRules,
) -> Pick:
    """The cheapest capable candidate that can take ``request`` in time.

    Without a deadline: the cheapest that can start now (a free slot and room
    in its quota), ties in cascade order. With one: the cheapest whose
    predicted finish (:func:`predict`) is before the deadline, ties to one
    that can start now, then cascade order (or, with ``rules.adapt``, the
    earliest predicted finish). That one may be unable to start yet (a free
    tier whose window resets in 20 s, for a request with a minute to spare):
    then the request waits for it rather than paying (``wait_for``), and is
    planned again next round. A candidate with no model yet that can start now
    is taken to be in time (it must be tried to be learned); one that cannot
    start is not waited for. When none is predicted in time, the one predicted
    to finish first among those that can start now; when none can start,
    ``NoRoom.FULL``.

    A route whose ``strategy`` is ``cascade`` gets :func:`choose` instead: the
    first candidate in cascade order with a free slot and room in its quota.
    """
    if rules.strategy == "cascade":
        choice, skipped = choose(request, candidates, views, cost, now)
        return Pick(backend=choice, passed=skipped)
    able = capable(request, candidates, views)
    if not able:
        return Pick(backend=NoRoom.NONE_CAPABLE, passed=[])
    passed: list[tuple[str, QuotaVerdict]] = []
    options: list[tuple[Prediction, int]] = []
    for index, view in enumerate(able):
        if view.free > 0 and (view.limits or view.quota is not None):
            verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
            if not verdict.ok:
                passed.append((view.name, verdict))
        options.append((predict(request, view, now, cost=cost, spread=rules.spread), index))
    startable = [(p, i) for p, i in options if p.now]
    if request.deadline is None:
        if not startable:
            return Pick(backend=NoRoom.FULL, passed=passed)
        best, index = min(startable, key=lambda option: (option[0].cost, option[1]))
        note = "" if index == startable[0][1] else f"cheapest with room: {best.backend}"
        return Pick(backend=best.backend, passed=passed, reason=note, prediction=best)
    return _in_time(request, request.deadline, options, passed, now=now, rules=rules)


def _in_time(
    request: InferenceRequest,
    deadline: float,
    options: Sequence[tuple[Prediction, int]],
    passed: list[tuple[str, QuotaVerdict]],
    *,
    now: float,
    rules: RouteRules,
) -> Pick:
    """:func:`choose_in_time` for a request with a deadline."""

    def timely(prediction: Prediction) -> bool:
        if prediction.finish is None:
            return prediction.now
        return prediction.finish <= deadline

    in_time = [option for option in options if timely(option[0])]
    if in_time:
        draw = _explorer(request, rules)
        best, _ = min(in_time, key=lambda option: _rank(option, draw, rules.adapt))
        why = _why(best, now, deadline, options)
        if best.now:
            return Pick(backend=best.backend, passed=passed, reason=why, prediction=best)
        return Pick(
            backend=NoRoom.FULL,
            passed=passed,
            wait_for=best.backend,
            wait_start=best.start,
            reason=why,
            prediction=best,
        )
    known = [option for option in options if option[0].now and option[0].finish is not None]
    if not known:
        return Pick(backend=NoRoom.FULL, passed=passed)
    best, _ = min(known, key=lambda option: (option[0].finish or 0.0, option[1]))
    late = (best.finish or now) - deadline
    return Pick(
        backend=best.backend,
        passed=passed,
        prediction=best,
        reason=f"no candidate predicted in time; {best.backend} is the soonest,"
        f" predicted {late:.1f} s late",
    )


def _rank(
    option: tuple[Prediction, int], draw: random.Random | None, adapt: bool
) -> tuple[float, int, float, int]:
    """Cheapest first; then one that can start now; then the cascade's order,
    or with ``adapt`` the earliest predicted finish (with ``draw``, a finish
    drawn from each one's spread: Thompson sampling)."""
    prediction, index = option
    speed = 0.0
    if adapt and prediction.finish is not None:
        speed = prediction.finish
        if draw is not None and prediction.mean_service is not None:
            sd = max(0.0, prediction.finish - prediction.start - prediction.mean_service)
            speed = prediction.start + max(0.0, draw.gauss(prediction.mean_service, sd))
    return (round(prediction.cost, 12), 0 if prediction.now else 1, speed, index)


def _explorer(request: InferenceRequest, rules: RouteRules) -> random.Random | None:
    """A draw for ``request`` if it is one of the ``explore`` share, else
    ``None``. Seeded by its tenant, id and requeues, so a replay of the log
    decides as the router did and a request put back draws anew."""
    if not rules.adapt or rules.explore <= 0:
        return None
    draw = random.Random(f"{request.tenant}:{request.id}:{request.requeues}")
    return draw if draw.random() < rules.explore else None


def _why(
    best: Prediction,
    now: float,
    deadline: float,
    options: Sequence[tuple[Prediction, int]],
) -> str:
    """``cheapest in time: local-large predicted 4.1 s of 10.0 s; free-a
    requests/min 30/30, resets in 12 s``: the choice and every candidate
    cheaper than it or earlier in the cascade, and why it was not chosen."""
    budget = deadline - now
    head = (
        f"cheapest in time: {best.backend}"
        + (f" ${best.cost:.6f}" if best.cost > 0 else "")
        + (
            f" predicted {best.finish - now:.1f} s of {budget:.1f} s"
            if best.finish is not None
            else f" (no model yet) of {budget:.1f} s"
        )
    )
    if not best.now:
        head += f" once it has room ({best.held}, in {best.start - now:.1f} s)"
    notes = [head]
    for prediction, _ in options:
        if prediction is best or prediction.cost > best.cost:
            continue
        if not prediction.now and prediction.start > deadline:
            notes.append(f"{prediction.backend} {prediction.held} past the deadline")
        elif prediction.finish is not None and prediction.finish > deadline:
            notes.append(
                f"{prediction.backend} predicted {prediction.finish - now:.1f} s"
                + (f" ({prediction.held})" if prediction.held else "")
            )
        elif not prediction.now:
            notes.append(f"{prediction.backend} {prediction.held}")
    return "; ".join(notes)
