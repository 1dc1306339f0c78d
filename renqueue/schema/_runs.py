"""One constructor per event: a run's events from its :class:`Run`, a
request's endings (and its binding, :func:`routed`) from the request.

The worker, the router, the coalescer and the what-if simulator all record
the same events; each builds them here, so the fields an event carries are
spelled once and a new field reaches every writer at the same time.
"""

from __future__ import annotations

from msgspec import Struct

from ._messages import (
    Cancelled,
    CancelRequested,
    CircuitChanged,
    Coalesced,
    Completed,
    ComplexityEstimate,
    Dispatch,
    ErrorType,
    Expired,
    Failed,
    Fallback,
    FellBack,
    InferenceRequest,
    Preempted,
    Probed,
    Promoted,
    Rejected,
    ReportedLimit,
    Retrying,
    Routed,
    SplitChanged,
    Started,
    Stolen,
    Submitted,
    TokenLogprob,
    ToolCall,
    Usage,
)
from ._subjects import SYSTEM_TENANT

__all__ = [
    "Run",
    "arm_of",
    "bound_at_once",
    "cancel_requested",
    "cancelled",
    "circuit_changed",
    "coalesced",
    "expired",
    "failed",
    "probed",
    "promoted",
    "rejected",
    "routed",
    "split_changed",
    "stolen",
    "submitted",
]


class Run(Struct, frozen=True, kw_only=True):
    """One run of a request: its dispatch's ``attempt`` on ``backend``, the
    ``delivery``-th time it was delivered. The facts every event of a run
    carries, which make it one the fold, the audit and the client can place."""

    request_id: str
    tenant: str
    backend: str
    attempt: int
    delivery: int

    @classmethod
    def of(cls, dispatch: Dispatch, delivery: int, *, backend: str | None = None) -> Run:
        """The run of ``dispatch`` at its ``delivery``-th delivery."""
        request = dispatch.request
        return cls(
            request_id=request.id,
            tenant=request.tenant,
            backend=dispatch.backend if backend is None else backend,
            attempt=dispatch.attempt,
            delivery=delivery,
        )

    def started(self, *, at: float, worker: str) -> Started:
        return Started(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            backend=self.backend,
            attempt=self.attempt,
            delivery=self.delivery,
            worker=worker,
        )

    def preempted(self, *, at: float, by: str) -> Preempted:
        return Preempted(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            backend=self.backend,
            attempt=self.attempt,
            delivery=self.delivery,
            by=by,
        )

    def retrying(
        self,
        *,
        at: float,
        error_type: ErrorType,
        reason: str,
        retry_after: float,
        error_class: str = "",
        limits: tuple[ReportedLimit, ...] = (),
        quota_exhausted_until: float | None = None,
        requeued: bool = False,
    ) -> Retrying:
        return Retrying(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            backend=self.backend,
            attempt=self.attempt,
            delivery=self.delivery,
            error_type=error_type,
            reason=reason,
            retry_after=retry_after,
            limits=limits,
            quota_exhausted_until=quota_exhausted_until,
            requeued=requeued,
            error_class=error_class,
        )

    def fell_back(
        self,
        *,
        at: float,
        error_type: ErrorType,
        error_class: str,
        reason: str,
        fallback: Fallback,
        probe: bool = False,
        limits: tuple[ReportedLimit, ...] = (),
        retry_after: float = 0.0,
    ) -> FellBack:
        return FellBack(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            backend=self.backend,
            attempt=self.attempt,
            delivery=self.delivery,
            error_type=error_type,
            error_class=error_class,
            reason=reason,
            fallback=fallback,
            probe=probe,
            limits=limits,
            retry_after=retry_after,
        )

    def completed(
        self,
        *,
        at: float,
        text: str,
        usage: Usage,
        cost: float,
        finish_reason: str | None = None,
        ttft: float | None = None,
        duration: float = 0.0,
        limits: tuple[ReportedLimit, ...] = (),
        reserved_tokens: int = 0,
        tool_calls: tuple[ToolCall, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> Completed:
        return Completed(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            backend=self.backend,
            attempt=self.attempt,
            delivery=self.delivery,
            text=text,
            usage=usage,
            cost=cost,
            finish_reason=finish_reason,
            ttft=ttft,
            duration=duration,
            limits=limits,
            reserved_tokens=reserved_tokens,
            tool_calls=tool_calls,
            logprobs=logprobs,
        )

    def expired(self, *, at: float, stage: str, reason: str = "") -> Expired:
        """The run's request expired at its worker (before its call or during it)."""
        return expired(
            self.request_id,
            self.tenant,
            at=at,
            stage=stage,
            reason=reason,
            backend=self.backend,
            attempt=self.attempt,
        )

    def cancelled(self, *, at: float, stage: str, reason: str = "") -> Cancelled:
        """The run's request was cancelled at its worker (before its call or during it)."""
        return cancelled(
            self.request_id,
            self.tenant,
            at=at,
            stage=stage,
            reason=reason,
            backend=self.backend,
            attempt=self.attempt,
        )

    def failed(
        self,
        *,
        at: float,
        error_type: ErrorType,
        reason: str,
        error_class: str = "",
        limits: tuple[ReportedLimit, ...] = (),
        quota_exhausted_until: float | None = None,
    ) -> Failed:
        """The run's request failed, for good, on this run's backend."""
        return Failed(
            request_id=self.request_id,
            tenant=self.tenant,
            at=at,
            error_type=error_type,
            reason=reason,
            backend=self.backend,
            attempt=self.attempt,
            limits=limits,
            quota_exhausted_until=quota_exhausted_until,
            error_class=error_class,
        )


def failed(
    request_id: str,
    tenant: str,
    *,
    at: float,
    error_type: ErrorType,
    reason: str,
    error_class: str = "",
    backend: str | None = None,
    attempt: int = 0,
) -> Failed:
    """A request failed for good outside a run (out of deliveries, no backend
    left, its coalescing leader failed)."""
    return Failed(
        request_id=request_id,
        tenant=tenant,
        at=at,
        error_type=error_type,
        reason=reason,
        backend=backend,
        attempt=attempt,
        error_class=error_class,
    )


def expired(
    request_id: str,
    tenant: str,
    *,
    at: float,
    stage: str,
    reason: str = "",
    split: str = "",
    arm: str = "",
    backend: str | None = None,
    attempt: int = 0,
) -> Expired:
    """A request's deadline passed at ``stage`` (``queued``, ``running``, ...);
    ``backend`` and ``attempt`` name the run a worker ended it at
    (:meth:`Run.expired`)."""
    return Expired(
        request_id=request_id,
        tenant=tenant,
        at=at,
        stage=stage,
        reason=reason,
        split=split,
        arm=arm,
        backend=backend,
        attempt=attempt,
    )


def cancelled(
    request_id: str,
    tenant: str,
    *,
    at: float,
    stage: str,
    reason: str = "",
    backend: str | None = None,
    attempt: int = 0,
) -> Cancelled:
    """A request was cancelled at ``stage``; ``backend`` and ``attempt`` name
    the run a worker ended it at (:meth:`Run.cancelled`)."""
    return Cancelled(
        request_id=request_id,
        tenant=tenant,
        at=at,
        stage=stage,
        reason=reason,
        backend=backend,
        attempt=attempt,
    )


def rejected(
    request_id: str, tenant: str, *, at: float, error_type: ErrorType, reason: str
) -> Rejected:
    """A request was refused at admission: ``request_id`` and ``tenant`` are
    what its subject and header said, the body may not have been readable."""
    return Rejected(
        request_id=request_id, tenant=tenant, at=at, error_type=error_type, reason=reason
    )


def stolen(
    dispatch: Dispatch, *, at: float, from_backend: str, to_backend: str, from_seq: int
) -> Stolen:
    """An idle replica moved ``dispatch`` (queued at ``from_seq`` for
    ``from_backend``, a busy sibling in its pool) to ``to_backend``."""
    request = dispatch.request
    return Stolen(
        request_id=request.id,
        tenant=request.tenant,
        at=at,
        from_backend=from_backend,
        to_backend=to_backend,
        attempt=dispatch.attempt,
        from_seq=from_seq,
    )


def probed(backend: str, *, at: float, ok: bool, detail: str, worker: str) -> Probed:
    """A worker's health probe of ``backend`` changed its answer (or gave its
    first): an event about the backend, under the system tenant."""
    return Probed(
        request_id=backend,
        tenant=SYSTEM_TENANT,
        at=at,
        backend=backend,
        ok=ok,
        detail=detail,
        worker=worker,
    )


def routed(
    request: InferenceRequest,
    *,
    at: float,
    backend: str,
    attempt: int,
    priority: str,
    queue_wait: float,
    reason: str = "",
    router: str = "",
    term: int = 0,
    reserved_tokens: int = 0,
    probe: bool = False,
    complexity_estimate: ComplexityEstimate | None = None,
    predicted: float | None = None,
    estimated_cost: float = 0.0,
) -> Routed:
    """``request`` was bound to ``backend`` for its ``attempt``-th dispatch,
    from level ``priority`` after waiting ``queue_wait``; its A/B split and
    arm are read from the request (:func:`arm_of`)."""
    split, arm = arm_of(request)
    return Routed(
        request_id=request.id,
        tenant=request.tenant,
        at=at,
        backend=backend,
        attempt=attempt,
        priority=priority,
        queue_wait=queue_wait,
        reason=reason,
        router=router,
        term=term,
        reserved_tokens=reserved_tokens,
        probe=probe,
        complexity_estimate=complexity_estimate,
        predicted=predicted,
        estimated_cost=estimated_cost,
        split=split,
        arm=arm,
    )


def submitted(
    request: InferenceRequest,
    *,
    at: float,
    traceparent: str | None = None,
    read: float | None = None,
) -> Submitted:
    """The log's first word on ``request``: its wait began ``at`` (server time),
    in the trace ``traceparent`` names (W3C, as the router sent it on);
    ``read``: when the binder read it, if the event is not stored as it is read."""
    return Submitted(
        request_id=request.id,
        tenant=request.tenant,
        at=at,
        request=request,
        traceparent=traceparent,
        read=read,
    )


def bound_at_once(first: Submitted, decision: Routed) -> Submitted:
    """``first`` (a request's ``submitted``) carrying its first binding,
    ``decision``: the one stored event of a request the binder bound in the
    first round after it read it (:func:`~renqueue.schema.facts` reads it as
    the pair)."""
    if (decision.tenant, decision.request_id) != (first.tenant, first.request_id):
        raise ValueError("a request's submitted event carries only its own binding")
    return Submitted(
        request_id=first.request_id,
        tenant=first.tenant,
        at=first.at,
        request=first.request,
        traceparent=first.traceparent,
        routed=decision,
        read=first.read,
    )


def arm_of(request: InferenceRequest) -> tuple[str, str]:
    """``(split, arm)`` as a request's events carry them: the route its client
    named and the arm (a route) its A/B split placed it on; empty when its
    route has no split."""
    if request.split is None:
        return "", ""
    return request.split, request.route


def promoted(
    request_id: str,
    tenant: str,
    *,
    at: float,
    from_level: str,
    to_level: str,
    waited: float,
    reason: str = "",
) -> Promoted:
    """A waiting request moved up from ``from_level`` to ``to_level``."""
    return Promoted(
        request_id=request_id,
        tenant=tenant,
        at=at,
        from_level=from_level,
        to_level=to_level,
        waited=waited,
        reason=reason,
    )


def coalesced(request_id: str, tenant: str, *, at: float, leader: str) -> Coalesced:
    """A request joined ``leader``'s call instead of making its own."""
    return Coalesced(request_id=request_id, tenant=tenant, at=at, leader=leader)


def cancel_requested(
    request_id: str, tenant: str, *, at: float, reason: str = ""
) -> CancelRequested:
    """A tenant asked to cancel its request (the one event a tenant writes)."""
    return CancelRequested(request_id=request_id, tenant=tenant, at=at, reason=reason)


def circuit_changed(
    backend: str,
    *,
    at: float,
    state: str,
    previous: str,
    reason: str,
    router: str = "",
    term: int = 0,
) -> CircuitChanged:
    """``backend``'s circuit moved from ``previous`` to ``state``: an event about
    the backend, under the system tenant."""
    return CircuitChanged(
        request_id=backend,
        tenant=SYSTEM_TENANT,
        at=at,
        backend=backend,
        state=state,
        previous=previous,
        reason=reason,
        router=router,
        term=term,
    )


def split_changed(
    route: str,
    *,
    at: float,
    state: str,
    arm: str,
    previous: str,
    reason: str,
    router: str = "",
    term: int = 0,
    operator: str = "",
) -> SplitChanged:
    """``route``'s A/B split moved from ``previous`` to ``state`` (by the binder,
    or by ``operator``): an event about the route, under the system tenant."""
    return SplitChanged(
        request_id=route,
        tenant=SYSTEM_TENANT,
        at=at,
        route=route,
        state=state,
        arm=arm,
        previous=previous,
        reason=reason,
        router=router,
        term=term,
        operator=operator,
    )
