"""The routing decision for one request, and the checks before it, as plain functions.

:func:`validate` judges a decoded request against the subject it came on and
the config; :func:`choose_backend` picks, among a route's candidates in cascade
order, the first that is healthy, of a tier the request needs and has a free
slot; :func:`hopeless` tells early that no candidate can finish before the
deadline. A :class:`BackendView` is what such a decision knows of one backend
at one moment. The round planner (:func:`renqueue.policy.plan`) applies them to
everything a router holds.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import msgspec

from ..errors import (
    MalformedRequestError,
    NoCapableBackendError,
    OutOfRangeError,
    OverCostCapError,
    PriorityNotAllowedError,
    UnknownRouteError,
    UnsupportedFeatureError,
)
from ..schema import (
    MAX_DEADLINE_AHEAD,
    MAX_EXTRA_BYTES,
    MAX_JSON_DEPTH,
    MAX_METADATA_BYTES,
    MAX_STOP_LENGTH,
    OLDEST_VERSION,
    RESERVED_EXTRA,
    SCHEMA_VERSION,
    SEED_MAX,
    SEED_MIN,
    SYSTEM_TENANT,
    Fallback,
    GenerationParams,
    InferenceRequest,
    msg_id,
    too_deep,
)
from ._features import ALL_FEATURES, missing, needs
from ._perf import Perf
from ._quota import Cost, Limit, Quota, QuotaVerdict, check
from ._tokens import DEFAULT_MAX_TOKENS, estimate_input_tokens

_NO_SPEND = Quota()


class NoRoom(enum.Enum):
    """Why no backend was chosen."""

    FULL = "every capable candidate is at capacity"
    NONE_CAPABLE = "no candidate is healthy and capable"


class Priced(Protocol):
    """What a cost estimate reads of a backend (a config, a view)."""

    @property
    def cost_input_per_mtok(self) -> float: ...

    @property
    def cost_output_per_mtok(self) -> float: ...


class Offered(Priced, Protocol):
    """What admission reads of a configured backend: its price and features."""

    @property
    def supports(self) -> frozenset[str]: ...


class Served(Protocol):
    """What admission reads of a configured route: its backends."""

    @property
    def backends(self) -> Sequence[str]: ...


class Catalog(Protocol):
    """What admission reads of the config (:class:`renqueue.config.Config` is
    one): this package never imports the config, which is built from it."""

    @property
    def backends(self) -> Mapping[str, Offered]: ...

    @property
    def routes(self) -> Mapping[str, Served]: ...

    def highest_tier(self, route: str) -> int: ...

    def max_priority_of(self, tenant: str) -> str | None: ...

    def priority_rank(self, level: str) -> int: ...


class Traits(Protocol):
    """What a fallback's constraints read of a backend (a view, a failure-policy candidate)."""

    @property
    def name(self) -> str: ...

    @property
    def tier(self) -> int: ...

    @property
    def context_window(self) -> int | None: ...

    @property
    def paid(self) -> bool: ...


class BackendView(msgspec.Struct, frozen=True, kw_only=True):
    """What a routing decision knows about one backend at one moment."""

    name: str
    capacity: int
    in_flight: int
    healthy: bool = True
    tier: int = 1
    #: What a call here is expected to take (seconds); ``None``: not known yet.
    expected_duration: float | None = None
    #: What its rate limits leave (``None``: nothing spent or reported yet),
    #: judged against ``limits`` (declared, tightened by what was learned).
    quota: Quota | None = None
    limits: tuple[Limit, ...] = ()
    #: Its declared context window in tokens (``None``: unknown).
    context_window: int | None = None
    #: US dollars per million input and output tokens (0: free).
    cost_input_per_mtok: float = 0.0
    cost_output_per_mtok: float = 0.0
    #: Its circuit is half-open: one call (the probe) at a time decides.
    half_open: bool = False
    #: Its learned speed and reliability (``None``: nothing learned yet).
    perf: Perf | None = None
    #: Requests planned this round to wait for one of its slots (a cheaper
    #: choice than binding elsewhere now): later ones queue behind them.
    queued: int = 0
    #: What it can do beyond text (``policy.needs``).
    features: frozenset[str] = ALL_FEATURES

    @property
    def paid(self) -> bool:
        return self.cost_input_per_mtok > 0 or self.cost_output_per_mtok > 0

    @property
    def free(self) -> int:
        """Slots free now; a half-open backend has one, for its probe, while nothing runs there."""
        if self.half_open:
            return 1 if self.in_flight <= 0 and self.capacity > 0 else 0
        return max(0, self.capacity - self.in_flight)


def validate(
    request: InferenceRequest,
    *,
    level: str,
    tenant: str,
    config: Catalog,
    message_id: str | None = None,
    requeue: bool = False,
    now: float | None = None,
    route: str | None = None,
) -> None:
    """Check a decoded request against where it was published and the config.

    The subject is authoritative: a payload naming another tenant or level
    (or route, when the subject names one: ``route``) is rejected (a tenant
    must not be able to speak for another). ``message_id`` is the publish's
    ``Nats-Msg-Id``: it must be ``<tenant>:<id>`` (a requeue by the services:
    ``<tenant>:<id>:requeue:...``, see :func:`renqueue.broker.publish_stored`),
    so that deduplication is scoped by tenant. ``None`` skips that check (a
    request not read from the stream).
    ``requeue``: it was read from the services' requeue subject (which no
    tenant may publish to); only such a request may carry ``requeues`` (a
    tenant setting it ran one id many times at once, billed once), or a
    ``fallback`` (a tenant could not use it but to keep its own request away
    from backends; it is the services' word all the same) or a ``split`` (its
    A/B arm, the binder's choice). A request of a newer schema version than
    this code's is refused: its new fields would be dropped unread. Fields
    past admission's bounds (:func:`check_bounds`; ``now``, the broker's time
    of the request, bounds how far ahead its deadline may be) are refused
    :class:`OutOfRangeError`.
    """
    _check_services_fields(request, tenant, requeue=requeue)
    check_bounds(request, now=now)
    _check_subject(
        request,
        level=level,
        tenant=tenant,
        message_id=message_id,
        requeue=requeue,
        forwarded=route is not None,
    )
    if (
        route is not None
        and request.route != route
        and not (_is_forwarded(message_id) and request.route not in config.routes)
    ):
        # Binding split in groups: the subject decided which binder reads it.
        # A router's forwarded copy disagrees with its subject only when its
        # route is none the config has: that is told below (unknown_route),
        # as it would be unsplit.
        raise MalformedRequestError(
            f"route {request.route[:200]!r} does not match subject route {route!r}",
            request_id=request.id,
        )
    most = config.max_priority_of(tenant)
    if (
        most is not None
        and not requeue  # put back by the services at the level it was allowed
        and config.priority_rank(level) < config.priority_rank(most)
    ):
        raise PriorityNotAllowedError(tenant, level, most, request_id=request.id)
    _check_params(request)
    if request.route not in config.routes:
        raise UnknownRouteError(request.route, request_id=request.id)
    _check_servable(request, config)


#: The latest deadline any request may carry, whatever ``now`` (1 Jan 3000 UTC):
#: past it a time is no calendar's.
_LATEST_DEADLINE: Final = 32_503_680_000.0


def check_bounds(request: InferenceRequest, *, now: float | None = None) -> None:
    """Raise :class:`OutOfRangeError` for a field past admission's bounds
    (docs/wire-format.md, "Bounds"): its schema version ``v`` below
    :data:`~renqueue.schema.OLDEST_VERSION`; a ``params.stop`` sequence that is
    empty or over :data:`~renqueue.schema.MAX_STOP_LENGTH` characters; a
    ``params.seed`` outside a signed 64-bit integer; a ``deadline`` that is
    not a finite time, or further than
    :data:`~renqueue.schema.MAX_DEADLINE_AHEAD` past ``now`` (when given);
    ``metadata`` over :data:`~renqueue.schema.MAX_METADATA_BYTES` (keys and
    values, UTF-8); ``params.extra`` over :data:`~renqueue.schema.MAX_EXTRA_BYTES`
    (as JSON). A stop string (or an unknown parameter) of megabytes is never
    sent to a backend, nor kept in the log."""
    rid = request.id
    if request.v < OLDEST_VERSION:
        raise OutOfRangeError(
            "v",
            f"schema version {request.v} does not exist (1 to {SCHEMA_VERSION})",
            request_id=rid,
        )
    params = request.params
    for index, stop in enumerate(params.stop or ()):
        if not 0 < len(stop) <= MAX_STOP_LENGTH:
            raise OutOfRangeError(
                f"params.stop[{index}]",
                f"a stop sequence has 1 to {MAX_STOP_LENGTH} characters, this one {len(stop)}",
                request_id=rid,
            )
    if params.seed is not None and not SEED_MIN <= params.seed <= SEED_MAX:
        raise OutOfRangeError(
            "params.seed", "a seed is a signed 64-bit integer (-2^63 to 2^63-1)", request_id=rid
        )
    deadline = request.deadline
    if deadline is not None:
        latest = _LATEST_DEADLINE
        if now is not None:
            latest = min(latest, now + MAX_DEADLINE_AHEAD)
        if not math.isfinite(deadline) or deadline > latest:
            raise OutOfRangeError(
                "deadline",
                f"a deadline is a Unix time at most {MAX_DEADLINE_AHEAD / 86400:g} days ahead"
                f" of the submit, not {deadline:.6g}",
                request_id=rid,
            )
    metadata = request.metadata
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items()) if metadata else 0
    if size > MAX_METADATA_BYTES:
        raise OutOfRangeError(
            "metadata",
            f"{size} bytes of keys and values, over the {MAX_METADATA_BYTES} it may carry",
            request_id=rid,
        )
    if params.extra:
        extra = len(msgspec.json.encode(params.extra))
        if extra > MAX_EXTRA_BYTES:
            raise OutOfRangeError(
                "params.extra",
                f"{extra} bytes of parameters Ren-Queue does not know (as JSON), over the "
                f"{MAX_EXTRA_BYTES} a request may carry",
                request_id=rid,
            )


def _check_services_fields(request: InferenceRequest, tenant: str, *, requeue: bool) -> None:
    """What only the services may set (on the requeue subject), and what this
    code must be new enough to read."""
    if request.v > SCHEMA_VERSION:
        raise MalformedRequestError(
            f"schema version {request.v} is newer than this service's ({SCHEMA_VERSION}): "
            "upgrade the services before the clients",
            request_id=request.id,
        )
    if requeue != (request.requeues > 0):
        raise MalformedRequestError(
            "requeues is set by the services only, on rq.req.<priority>.<tenant>.requeue"
            if request.requeues > 0
            else "a request on the requeue subject must carry requeues > 0",
            request_id=request.id,
        )
    if tenant == SYSTEM_TENANT:
        raise MalformedRequestError(
            f"tenant {SYSTEM_TENANT!r} is reserved for the services' events about backends",
            request_id=request.id,
        )
    if request.fallback is not None and not requeue:
        raise MalformedRequestError(
            "fallback is set by the services only, on rq.req.<priority>.<tenant>.requeue",
            request_id=request.id,
        )
    if request.split is not None and not requeue:
        # A client choosing its own arm would skew the experiment.
        raise MalformedRequestError(
            "split is set by the services only, on rq.req.<priority>.<tenant>.requeue",
            request_id=request.id,
        )


def _is_forwarded(message_id: str | None) -> bool:
    """Whether ``message_id`` is a router's forwarded copy's (``...:forwarded``,
    or ``...:forwarded:<uuid4 hex>`` when its id was taken first, see
    :func:`renqueue.broker.surely_stored`)."""
    if message_id is None:
        return False
    head, _, suffix = message_id.rpartition(":")
    return message_id.endswith(":forwarded") or (head.endswith(":forwarded") and _is_suffix(suffix))


def _is_suffix(text: str) -> bool:
    """Whether ``text`` is the random suffix an id taken first is published
    again with (a uuid4's 32 hex digits, :func:`renqueue.broker.surely_stored`)."""
    return len(text) == _SUFFIX_LENGTH and all(c in _HEX for c in text)


_SUFFIX_LENGTH: Final = 32
_HEX: Final = frozenset("0123456789abcdef")


def _check_subject(
    request: InferenceRequest,
    *,
    level: str,
    tenant: str,
    message_id: str | None,
    requeue: bool,
    forwarded: bool = False,
) -> None:
    """The request is what its subject and message id say: their tenant and level.

    ``forwarded``: the subject names a route, so the id may be a router's
    forwarded copy's (``<tenant>:<id>:forwarded``, see
    :mod:`renqueue.services.router._forward`; followed by ``:<uuid4 hex>`` when
    another tenant took that id first, :func:`renqueue.broker.surely_stored`)."""
    copy = msg_id(tenant, request.id, "forwarded") if forwarded else ""
    if message_id is not None and not (
        message_id == msg_id(tenant, request.id)
        or (
            forwarded
            and (
                message_id == copy
                or (message_id.startswith(f"{copy}:") and _is_suffix(message_id[len(copy) + 1 :]))
            )
        )
        or (requeue and message_id.startswith(msg_id(tenant, request.id, "requeue")))
    ):
        raise MalformedRequestError(
            f"the Nats-Msg-Id header must be {msg_id(tenant, request.id)!r} "
            f"(<tenant>:<request id>), got {message_id[:200]!r}",
            request_id=request.id,
        )
    if request.tenant != tenant:
        raise MalformedRequestError(
            f"tenant {request.tenant!r} does not match subject tenant {tenant!r}",
            request_id=request.id,
        )
    if request.priority != level:
        raise MalformedRequestError(
            f"priority {request.priority!r} does not match subject level {level!r}",
            request_id=request.id,
        )


_PARAM_FIELDS: Final = frozenset(GenerationParams.__struct_fields__)


def _check_params(request: InferenceRequest) -> None:
    """Raise :class:`MalformedRequestError` for pass-through parameters that
    would act behind the router's back (:data:`RESERVED_EXTRA`) or that are
    Ren-Queue's own fields, and for free-form JSON nested past
    :data:`MAX_JSON_DEPTH` (adapters and providers recurse into it)."""
    params = request.params
    schema = params.response_format.json_schema if params.response_format else None
    if not (params.extra or params.tools or schema):
        return  # (most requests: nothing free-form to look into)
    reserved = sorted(key for key in params.extra if key in RESERVED_EXTRA)
    if reserved:
        raise MalformedRequestError(
            f"params.extra may not set {', '.join(reserved)[:200]}: it would change the "
            "call's cost, model or what the provider keeps behind the router",
            request_id=request.id,
        )
    known = sorted(key for key in params.extra if key in _PARAM_FIELDS)
    if known:
        raise MalformedRequestError(
            f"give {', '.join(known)[:200]} as params fields, not in params.extra",
            request_id=request.id,
        )
    nested = [
        ("params.extra", params.extra),
        *((f"params.tools[{i}].parameters", t.parameters) for i, t in enumerate(params.tools)),
        ("params.response_format.json_schema.schema", schema.schema if schema else None),
    ]
    for where, value in nested:
        if too_deep(value):
            raise MalformedRequestError(
                f"{where} is nested deeper than {MAX_JSON_DEPTH} levels", request_id=request.id
            )


def _check_servable(request: InferenceRequest, config: Catalog) -> None:
    """Raise if no backend of its route could ever serve ``request``: its cost
    cap, the features it needs, its complexity (decided from the config
    alone, so final)."""
    if request.max_cost is not None:
        # A request whose cost cap no candidate can meet (held, it would wait forever).
        costs = [
            estimated_cost(request, config.backends[name])
            for name in config.routes[request.route].backends
            if name in config.backends
        ]
        if costs and min(costs) > request.max_cost:
            raise OverCostCapError(
                request.route, request.max_cost, min(costs), request_id=request.id
            )
    _check_features(request, config)
    if request.complexity is not None:
        # Held, a request no backend can ever serve would wait forever and,
        # many of them, fill the level's hold for every tenant.
        best = config.highest_tier(request.route)
        if request.complexity > best:
            raise NoCapableBackendError(
                request.route, request.complexity, best, request_id=request.id
            )


def _check_features(request: InferenceRequest, config: Catalog) -> None:
    """Raise :class:`UnsupportedFeatureError` if no backend of its route has
    every feature ``request`` needs."""
    need = needs(request)
    if need:
        # As for complexity: held, it would wait forever.
        served = [
            config.backends[name].supports
            for name in config.routes[request.route].backends
            if name in config.backends
        ]
        if not any(need <= has for has in served):
            # The features no backend has; else (each has some) all of them together.
            lacking = missing(need, frozenset().union(*served)) or missing(need, ())
            raise UnsupportedFeatureError(request.route, lacking, request_id=request.id)


def capable(
    request: InferenceRequest, candidates: Sequence[str], views: Mapping[str, BackendView]
) -> list[BackendView]:
    """The candidates (cascade order) that are healthy, of a tier the request
    needs, with the features it needs (:func:`needs`), whose estimated cost is
    within its ``max_cost`` (:func:`within_cost`) and, for a request that fell
    back, allowed by its ``fallback`` (:func:`allowed_after_fallback`)."""
    need: frozenset[str] | None = None
    able = []
    for name in candidates:
        view = views.get(name)
        if (
            view is None
            or not view.healthy
            or (request.complexity is not None and view.tier < request.complexity)
            or (request.max_cost is not None and not within_cost(request, view))
            or (request.fallback is not None and not allowed_after_fallback(request, view))
        ):
            continue
        if view.features is not ALL_FEATURES:
            if need is None:
                need = needs(request)  # once, and only where a backend lacks some
            if not need <= view.features:
                continue
        able.append(view)
    return able


def allowed_after_fallback(request: InferenceRequest, view: BackendView) -> bool:
    """Whether a request that fell back may go to ``view``: not a backend that
    failed it in this pass over its route, a context window as large as it
    needs, and no lower tier or no paid backend when its route says so."""
    fallback = request.fallback
    return fallback is None or (view.name not in fallback.excluded and meets(view, fallback))


def meets(backend: Traits, fallback: Fallback) -> bool:
    """Whether ``backend`` meets a fallback's constraints (``excluded`` aside):
    never one that said the context is too long, a tier no lower than
    ``min_tier``, a declared window of at least ``min_context``, free if
    ``free_only``."""
    if backend.name in fallback.too_small:
        return False
    if fallback.min_tier is not None and backend.tier < fallback.min_tier:
        return False
    if fallback.free_only and backend.paid:
        return False
    return fallback.min_context is None or (
        backend.context_window is not None and backend.context_window >= fallback.min_context
    )


def estimated_cost(request: InferenceRequest, backend: Priced) -> float:
    """US dollars a call of ``request`` may cost at ``backend`` (a config or a
    view): its estimated prompt and the most it may generate (``max_tokens``,
    else :data:`DEFAULT_MAX_TOKENS`)."""
    if not (backend.cost_input_per_mtok or backend.cost_output_per_mtok):
        return 0.0  # a free backend (most local ones): no prompt to estimate
    prompt = estimate_input_tokens(request)
    output = request.params.max_tokens or DEFAULT_MAX_TOKENS
    return (
        prompt * backend.cost_input_per_mtok + output * backend.cost_output_per_mtok
    ) / 1_000_000


def within_cost(request: InferenceRequest, view: BackendView) -> bool:
    """Whether the estimated cost of ``request`` at ``view`` is within its ``max_cost``."""
    return request.max_cost is None or estimated_cost(request, view) <= request.max_cost


def choose_backend(
    request: InferenceRequest, candidates: Sequence[str], views: Mapping[str, BackendView]
) -> str | NoRoom:
    """The first healthy, capable candidate (cascade order) with a free slot."""
    return choose(request, candidates, views, None, 0.0)[0]


def choose(
    request: InferenceRequest,
    candidates: Sequence[str],
    views: Mapping[str, BackendView],
    cost: Cost | None,
    now: float,
) -> tuple[str | NoRoom, list[tuple[str, QuotaVerdict]]]:
    """The first capable candidate with a free slot and, unless ``cost`` is
    ``None``, room in its quota for ``cost`` at ``now``; and the candidates
    with a free slot passed over for their quota (cascade order)."""
    able = capable(request, candidates, views)
    if not able:
        return NoRoom.NONE_CAPABLE, []
    passed: list[tuple[str, QuotaVerdict]] = []
    for view in able:
        if view.free <= 0:
            continue
        # Judged where there are limits, or a provider's cooldown.
        if cost is not None and (view.limits or view.quota is not None):
            verdict = check(view.quota or _NO_SPEND, view.limits, cost, now)
            if not verdict.ok:
                passed.append((view.name, verdict))
                continue
        return view.name, passed
    return NoRoom.FULL, passed


def hopeless(deadline: float, now: float, expected: Sequence[float | None]) -> float | None:
    """Whether no candidate can finish before ``deadline``.

    ``expected`` holds each candidate's expected call duration (``None``:
    unknown, which is never hopeless). Returns the best estimate of when the
    request could finish when that is past the deadline, else ``None``.
    """
    if not expected or any(duration is None for duration in expected):
        return None
    best = now + min(duration for duration in expected if duration is not None)
    return best if best > deadline else None
