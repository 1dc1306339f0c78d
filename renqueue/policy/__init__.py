"""Every decision Ren-Queue makes, as plain functions of (state, input) -> output.

No clock, no I/O, no NATS: the services (router, worker, projector) are loops
that read the broker, ask these functions, and carry out what they answer.

- Aging and pick order (``_aging``): :class:`LevelPolicy`, :func:`promotions`,
  :func:`effective_rank`, :func:`pick_key`, :func:`aging_bound`.
- One request's routing (``_routing``): :func:`validate`, :func:`capable`,
  :func:`choose_backend`, :func:`hopeless`, :class:`BackendView`, :class:`NoRoom`;
  a fallback's constraints, :func:`meets`; a cost estimate, :func:`estimated_cost`.
- A router's round (``_planner``): :func:`plan` over :class:`Waiting` requests
  and :class:`BackendView` s, under a :class:`PlanPolicy`, answering
  :data:`Action` s: :class:`Promote`, :class:`Inherit`, :class:`Expire`,
  :class:`Bind`, :class:`AskPreemption`, :class:`Wait` (the promise it
  keeps: :func:`promise`).
- Preemption (``_preemption``): :func:`may_preempt`, :func:`preempting_rank`,
  :func:`choose_victim`, :func:`least_urgent_victim`.
- A worker's failed run (``_failure``): :func:`after_failure` under a
  :class:`FailurePolicy` and a route's :class:`FallbackPolicy` (over its
  :class:`Candidate` s, :class:`RouteFacts`), answering :class:`Retry`,
  :class:`FallBack`, :class:`RequeueElsewhere` or :class:`Fail`;
  :func:`backoff`; what its events say of it: :func:`error_class_of`,
  :func:`exhausted_until`, :func:`left_out_for` (a spent quota),
  :func:`cool_down_for` (a 429), :func:`put_back_refused` (put back too often).
- A request's other endings, as the router and the worker record them
  (``_endings``): :func:`past_deadline`, :func:`expired_waiting`,
  :func:`expired_before_call`, :func:`expired_running`,
  :func:`cancelled_waiting`, :func:`cancelled_at_worker`, :func:`rejection`.
- Backend health (``_health``): the circuit breaker, :func:`next_circuit`
  (a :class:`Circuit` judged from :class:`CircuitFacts` under
  :class:`CircuitRules`); the older streak rule :func:`is_healthy`.
- Backend quotas (``_quota``, over the spend log of ``_spend``): :class:`Limit` s
  (:func:`limits_of`, :func:`effective_limits`) judged against a :class:`Quota`
  (one :class:`SpendLog` per backend, and what its provider said: a
  :class:`Learned` window, a cooldown) by :func:`check`, answering a
  :class:`QuotaVerdict` for a :class:`Cost`; :func:`used`, :func:`limit_usage`
  (:class:`LimitUsage`), :func:`reserve`,
  :func:`reconcile`, :func:`learn`, :func:`cool_down`.
- A request's difficulty when it names no tier (``_complexity``): the
  route's estimator, :func:`estimate_complexity` (a :class:`ComplexityEstimate`
  with its signals), over :func:`heuristic_score` or a learned :class:`Estimator`.
- Speed and cost (``_perf``, ``_predict``): a backend's :class:`Perf`
  (time to first token, token rate, output length with their spread, fault
  and 429 probability) folded by :func:`learn_call` and :func:`learn_fault`;
  :func:`predict` answers a :class:`Prediction` (start, finish, cost) of one
  request on one backend; :func:`service_time`; a route's choice under its
  :class:`RouteRules`, :func:`choose_in_time` (a :class:`Pick`).
- Tenant budgets per UTC day (``_budget``): a :class:`Budget` per tenant
  (:func:`budget_of`, :data:`EVERY_TENANT`), :func:`within_budget` (may it
  go to this backend), :func:`refused` (a hard budget spent), :func:`day_ends`;
  the refusal, :func:`over_budget` (at admission), :func:`budget_exhausted`.
- A/B splits (``_ab``): a request's arm, :func:`assign` (a stable hash of its
  sticky key, :func:`key_value`, against the arms' weights) and :func:`place`
  (the split's state and the arms' eligibility applied), :func:`on_arm` (the
  request placed there); what each arm did,
  :class:`ArmStats` of :class:`Tally` s (:func:`record`, :func:`windowed`,
  :func:`percentile`); the rollback rule, :func:`judge` over :func:`breach`
  under :class:`RollbackRules`.
- Token estimates for quota reservations, no tokenizer download (``_tokens``):
  :func:`estimate_text_tokens`, :func:`estimate_prompt_tokens`, :func:`estimate_input_tokens`,
  :func:`estimate_request_tokens`.
"""

from ._ab import (
    AB_BUCKET,
    AB_HORIZON,
    SPLIT_MODES,
    ArmStats,
    ArmTally,
    RollbackRules,
    SplitFacts,
    SplitPolicy,
    SplitStatus,
    Tally,
    assign,
    bin_of,
    breach,
    judge,
    key_value,
    moved_to,
    on_arm,
    percentile,
    place,
    record,
    windowed,
)
from ._aging import LevelPolicy, aging_bound, effective_rank, pick_key, promotions
from ._budget import (
    EVERY_TENANT,
    Budget,
    affordable,
    budget_exhausted,
    budget_of,
    day_ends,
    over_budget,
    refused,
    within_budget,
)
from ._complexity import (
    Estimator,
    heuristic_score,
    load_estimator,
    tier_of,
)
from ._complexity import estimate as estimate_complexity
from ._endings import (
    cancelled_at_worker,
    cancelled_waiting,
    expired_before_call,
    expired_running,
    expired_waiting,
    past_deadline,
    rejection,
)
from ._failure import (
    DEFAULT_FALLBACK_ON,
    INTERNAL,
    QUOTA_EXHAUSTED,
    RETRY_HERE_FIRST,
    WAIT_HERE_IF_ALONE,
    Candidate,
    Fail,
    FailureAction,
    FailurePolicy,
    FallBack,
    FallbackPolicy,
    RequeueElsewhere,
    Retry,
    RouteFacts,
    after_failure,
    backoff,
    cool_down_for,
    error_class_of,
    exhausted_until,
    left_out_for,
    put_back_refused,
    retry_after,
)
from ._features import ALL_FEATURES, FEATURES, Feature, missing, needs
from ._health import (
    CLOSED,
    DEFAULT_COOLDOWN,
    DEFAULT_FAILURE_THRESHOLD,
    OUTCOME_BUCKET,
    OUTCOME_HORIZON,
    Circuit,
    CircuitFacts,
    CircuitRules,
    CircuitState,
    FaultRecord,
    is_healthy,
    next_circuit,
)
from ._perf import MIN_SAMPLES, Perf, learn_call, learn_fault
from ._planner import (
    BIND_REASON,
    DEADLINE_PASSED,
    PREEMPT_RETRY,
    Action,
    AskPreemption,
    Bind,
    Expire,
    Inherit,
    PlanPolicy,
    Promote,
    Refuse,
    Wait,
    Waiting,
    nothing_could_serve,
    plan,
    promise,
    urgency,
)
from ._predict import (
    Pick,
    Prediction,
    RouteRules,
    choose_in_time,
    predict,
    service_time,
    typical_call,
)
from ._preemption import choose_victim, least_urgent_victim, may_preempt, preempting_rank
from ._quota import (
    Cost,
    Learned,
    Limit,
    LimitUsage,
    Quota,
    QuotaVerdict,
    check,
    cool_down,
    effective_limits,
    learn,
    limit_usage,
    limits_of,
    reconcile,
    reserve,
    says_anything,
    used,
)
from ._routing import (
    BackendView,
    NoRoom,
    capable,
    check_bounds,
    choose_backend,
    estimated_cost,
    hopeless,
    meets,
    validate,
)
from ._spend import SpendLog
from ._tokens import (
    CHARS_PER_TOKEN,
    DEFAULT_MAX_TOKENS,
    IMAGE_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_OVERHEAD_TOKENS,
    estimate_input_tokens,
    estimate_prompt_tokens,
    estimate_request_tokens,
    estimate_text_tokens,
)

__all__ = [
    "AB_BUCKET",
    "AB_HORIZON",
    "ALL_FEATURES",
    "BIND_REASON",
    "CHARS_PER_TOKEN",
    "CLOSED",
    "DEADLINE_PASSED",
    "DEFAULT_COOLDOWN",
    "DEFAULT_FAILURE_THRESHOLD",
    "DEFAULT_FALLBACK_ON",
    "DEFAULT_MAX_TOKENS",
    "EVERY_TENANT",
    "FEATURES",
    "IMAGE_TOKENS",
    "INTERNAL",
    "MESSAGE_OVERHEAD_TOKENS",
    "MIN_SAMPLES",
    "OUTCOME_BUCKET",
    "OUTCOME_HORIZON",
    "PREEMPT_RETRY",
    "QUOTA_EXHAUSTED",
    "REPLY_OVERHEAD_TOKENS",
    "RETRY_HERE_FIRST",
    "SPLIT_MODES",
    "WAIT_HERE_IF_ALONE",
    "Action",
    "ArmStats",
    "ArmTally",
    "AskPreemption",
    "BackendView",
    "Bind",
    "Budget",
    "Candidate",
    "Circuit",
    "CircuitFacts",
    "CircuitRules",
    "CircuitState",
    "Cost",
    "Estimator",
    "Expire",
    "Fail",
    "FailureAction",
    "FailurePolicy",
    "FallBack",
    "FallbackPolicy",
    "FaultRecord",
    "Feature",
    "Inherit",
    "Learned",
    "LevelPolicy",
    "Limit",
    "LimitUsage",
    "NoRoom",
    "Perf",
    "Pick",
    "PlanPolicy",
    "Prediction",
    "Promote",
    "Quota",
    "QuotaVerdict",
    "Refuse",
    "RequeueElsewhere",
    "Retry",
    "RollbackRules",
    "RouteFacts",
    "RouteRules",
    "SpendLog",
    "SplitFacts",
    "SplitPolicy",
    "SplitStatus",
    "Tally",
    "Wait",
    "Waiting",
    "affordable",
    "after_failure",
    "aging_bound",
    "assign",
    "backoff",
    "bin_of",
    "breach",
    "budget_exhausted",
    "budget_of",
    "cancelled_at_worker",
    "cancelled_waiting",
    "capable",
    "check",
    "check_bounds",
    "choose_backend",
    "choose_in_time",
    "choose_victim",
    "cool_down",
    "cool_down_for",
    "day_ends",
    "effective_limits",
    "effective_rank",
    "error_class_of",
    "estimate_complexity",
    "estimate_input_tokens",
    "estimate_prompt_tokens",
    "estimate_request_tokens",
    "estimate_text_tokens",
    "estimated_cost",
    "exhausted_until",
    "expired_before_call",
    "expired_running",
    "expired_waiting",
    "heuristic_score",
    "hopeless",
    "is_healthy",
    "judge",
    "key_value",
    "learn",
    "learn_call",
    "learn_fault",
    "least_urgent_victim",
    "left_out_for",
    "limit_usage",
    "limits_of",
    "load_estimator",
    "may_preempt",
    "meets",
    "missing",
    "moved_to",
    "needs",
    "next_circuit",
    "nothing_could_serve",
    "on_arm",
    "over_budget",
    "past_deadline",
    "percentile",
    "pick_key",
    "place",
    "plan",
    "predict",
    "preempting_rank",
    "promise",
    "promotions",
    "put_back_refused",
    "reconcile",
    "record",
    "refused",
    "rejection",
    "reserve",
    "retry_after",
    "says_anything",
    "service_time",
    "tier_of",
    "typical_call",
    "urgency",
    "used",
    "validate",
    "windowed",
    "within_budget",
]
