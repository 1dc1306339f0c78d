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

import functools
import math
import random
from collections.abc import Container, Mapping, Sequence
from typing import Final

import msgspec
from msgspec import Struct

from ..schema import InferenceRequest
from ._perf import MIN_SAMPLES, Perf
from ._quota import Cost, Quota, QuotaVerdict, check
from ._routing import BackendView, NoRoom, capable, choose, estimated_cost

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
    #: Its quota (not only its slots) holds it back.
    quota_held: bool = False
    #: The mean service time (no spread, no wait): what an early "hopeless"
    #: verdict is judged by; ``None``: no model yet.
    mean_service: float | None = None

    @property
    def now(self) -> bool:
        """It can start at once."""
        return not self.held


def service_time(
    request: InferenceRequest,
    view: BackendView,
    *,
    spread: float,
    min_samples: int = MIN_SAMPLES,
) -> float | None:
    """Seconds a call of ``request`` at ``view`` is expected to take once it
    starts, ``spread`` deviations cautious (0: the means); ``None``: not known."""
    return _service(
        view.perf, view.expected_duration, request.params.max_tokens, spread, min_samples
    )


@functools.lru_cache(maxsize=4096)
def _service(
    perf: Perf | None,
    expected: float | None,
    max_tokens: int | None,
    spread: float,
    min_samples: int,
) -> float | None:
    """:func:`service_time` of what it reads (cached: a round asks it of every
    waiting request and candidate, most of them alike)."""
    if perf is None or perf.samples < min_samples or not perf.rate >= _MIN_RATE:
        return expected
    ttft = perf.ttft + spread * perf.ttft_sd
    rate = max(perf.rate - spread * perf.rate_sd, perf.rate * _RATE_FLOOR)
    if spread > 0:
        tokens = (
            float(max_tokens) if max_tokens is not None else perf.output + spread * perf.output_sd
        )
    else:
        tokens = perf.output if max_tokens is None else min(float(max_tokens), perf.output)
    # A try that fails is time lost before the next: its expected share.
    retry = min(0.9, perf.fault_p + perf.limited_p) if spread > 0 else 0.0
    return (ttft + max(0.0, tokens - 1) / rate) * (1 + retry)


def typical_call(view: BackendView, *, min_samples: int = MIN_SAMPLES) -> float | None:
    """Seconds a typical call at ``view`` takes (its mean first token and mean
    output at its mean rate; else its mean call duration; ``None``: unknown)."""
    perf = view.perf
    if perf is None or perf.samples < min_samples or not perf.rate >= _MIN_RATE:
        return view.expected_duration
    return perf.ttft + max(0.0, perf.output - 1) / perf.rate


def predict(
    request: InferenceRequest,
    view: BackendView,
    now: float,
    *,
    cost: Cost,
    spread: float = 1.0,
    min_samples: int = MIN_SAMPLES,
    verdict: QuotaVerdict | None = None,
    price: float | None = None,
) -> Prediction:
    """When ``request`` would finish on ``view`` (see the module docstring) and
    what it would cost, if bound now or as soon as the backend has room.
    ``verdict`` and ``price``: its quota's verdict for ``cost`` at ``now`` and
    its estimated cost, when the caller has them already.

    A backend with a free slot and room in its quota starts it now. One whose
    quota is short starts when the quota says (its verdict's ``until``); one
    whose slots are all taken starts when enough calls ahead of it end: each
    of the ``in_flight - capacity + 1 + queued`` calls ahead takes a typical
    call there (:func:`typical_call`) over ``capacity`` slots (unknown without
    a model: then the start is unknown too, and so is the finish). How long the
    running calls have already run is not known here: a call that never ends
    keeps this start a constant ahead, which :func:`choose_in_time`'s
    ``overdue`` stops believing.
    """
    service = service_time(request, view, spread=spread, min_samples=min_samples)
    mean = service_time(request, view, spread=0.0, min_samples=min_samples)
    start = now
    held = ""
    quota_held = False
    if view.limits or view.quota is not None:
        if verdict is None:
            verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
        if not verdict.ok:
            start = max(start, verdict.until)
            held = verdict.reason
            quota_held = True
    if view.free <= 0:
        ahead = max(0, view.in_flight - view.capacity) + 1 + view.queued
        typical = typical_call(view, min_samples=min_samples)
        slot = None if typical is None or view.capacity <= 0 else ahead * typical / view.capacity
        start = math.inf if slot is None else max(start, now + slot)
        held = held or "every slot taken"
    finish = None if service is None or math.isinf(start) else start + service
    return Prediction(
        backend=view.name,
        start=start,
        finish=finish,
        cost=estimated_cost(request, view) if price is None else price,
        held=held,
        quota_held=quota_held,
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
    overdue: Container[str] = frozenset(),
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
    start is not waited for, and neither is one in ``overdue`` (it was waited
    for and the start it was promised long passed). A cheaper candidate is
    waited for only while the best one that can start now would still be in
    time if the wait came to nothing (it started at the promised start
    instead): the wait never costs the deadline. When none is predicted in
    time, the one predicted to finish first among those that can start now;
    when none can start, ``NoRoom.FULL``.

    A route whose ``strategy`` is ``cascade`` gets :func:`choose` instead: the
    first candidate in cascade order with a free slot and room in its quota.
    """
    if rules.strategy == "cascade":
        choice, skipped = choose(request, candidates, views, cost, now)
        return Pick(backend=choice, passed=skipped)
    able = capable(request, candidates, views)
    if not able:
        return Pick(backend=NoRoom.NONE_CAPABLE, passed=[])
    passed, options = _predictions(request, able, cost, now, rules)
    startable = [(p, i) for p, i in options if p.now]
    if request.deadline is None:
        if not startable:
            return Pick(backend=NoRoom.FULL, passed=passed)
        best, index = min(startable, key=lambda option: (option[0].cost, option[1]))
        # Named only when a dearer candidate comes first in the cascade (one
        # passed over for its quota is named by the caller, as a cascade would).
        dearer_first = any(estimated_cost(request, view) > best.cost for view in able[:index])
        note = f"cheapest with room: {best.backend}" if dearer_first else ""
        return Pick(backend=best.backend, passed=passed, reason=note, prediction=best)
    waitable = [(p, i) for p, i in options if p.now or p.backend not in overdue]
    pick = _in_time(request, request.deadline, waitable, passed, now=now, rules=rules)
    given_up = [p.backend for p, _ in options if not p.now and p.backend in overdue]
    if given_up and pick.reason:
        note = f"{', '.join(given_up)} not waited for again: the start it promised passed"
        return msgspec.structs.replace(pick, reason=f"{pick.reason}; {note}")
    return pick


def _predictions(
    request: InferenceRequest,
    able: Sequence[BackendView],
    cost: Cost,
    now: float,
    rules: RouteRules,
) -> tuple[list[tuple[str, QuotaVerdict]], list[tuple[Prediction, int]]]:
    """The predictions (with each candidate's cascade index) the choice needs,
    and the candidates with a free slot passed over for their quota.

    By price, cheapest first: once a price holds a candidate that can start
    now and is in time (without a deadline: that can start now), no dearer
    one can be chosen, nor be the safety net of a wait, so none is predicted
    (a round predicts for every waiting request, the quota checks are most
    of its time)."""
    deadline = request.deadline
    prices = [estimated_cost(request, view) for view in able]
    passed: list[tuple[str, QuotaVerdict]] = []
    options: list[tuple[Prediction, int]] = []
    for price in sorted(set(prices)):
        for index, view in enumerate(able):
            if prices[index] != price:
                continue
            verdict = None
            if view.limits or view.quota is not None:
                verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
                if view.free > 0 and not verdict.ok:
                    passed.append((view.name, verdict))
            prediction = predict(
                request, view, now, cost=cost, spread=rules.spread, verdict=verdict, price=price
            )
            options.append((prediction, index))
        if any(
            p.now and (deadline is None or (p.finish is None or p.finish <= deadline))
            for p, _ in options
        ):
            break
    options.sort(key=lambda option: option[1])
    passed.sort(key=lambda item: [view.name for view in able].index(item[0]))
    return passed, options


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
        ranked = sorted(in_time, key=lambda option: _rank(option, draw, rules.adapt))
        best = ranked[0][0]
        if not best.now:
            # The safety net: the best that can start now, started when the
            # wait is due to end instead, must still be in time.
            net = next((p for p, _ in ranked if p.now), None)
            if (
                net is not None
                and net.finish is not None
                and best.start + (net.finish - net.start) > deadline
            ):
                best = net
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
