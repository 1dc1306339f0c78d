"""Typed configuration, loaded from one TOML file and overridable from the environment.

Everything is validated at start-up: a bad file raises :class:`ConfigError`
naming the offending field (``$.backends.groq.limits.requests[0]``), never a
failure at the first request. API keys are never in the file: a backend names
the environment variable (``api_key_env``) or file (``api_key_file``) that
holds its key, and the key is read into a :class:`Secret` that never prints.

Environment overrides (applied after the file):

``RENQUEUE_NATS_URL``      connect to this server/cluster instead of the embedded one
``RENQUEUE_DATA_DIR``      embedded server's data directory
"""

from __future__ import annotations

import difflib
import itertools
import math
import os
import re
import tomllib
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from .errors import ConfigError, FailureClass
from .policy import (
    AB_BUCKET,
    AB_HORIZON,
    ALL_FEATURES,
    DEFAULT_FALLBACK_ON,
    EVERY_TENANT,
    Budget,
    Candidate,
    Estimator,
    FailurePolicy,
    FallbackPolicy,
    Feature,
    LevelPolicy,
    Limit,
    PlanPolicy,
    RollbackRules,
    RouteFacts,
    RouteRules,
    SplitPolicy,
    estimate_complexity,
    estimated_cost,
    limits_of,
    load_estimator,
    needs,
)

if TYPE_CHECKING:  # the wire is a layer above the config: annotations only
    from .schema import ComplexityEstimate, InferenceRequest

__all__ = [
    "ADAPTERS",
    "DEFAULT_PRIORITIES",
    "LEASE_BYTES",
    "STORE_SHARES",
    "AnthropicConfig",
    "AnyBackendConfig",
    "BackendConfig",
    "BaseBackendConfig",
    "BindingGroup",
    "BucketConfig",
    "ByteSize",
    "Config",
    "GatewayConfig",
    "GatewayKey",
    "GeminiConfig",
    "GeminiSafetySetting",
    "LevelConfig",
    "LimitStyle",
    "LimitsConfig",
    "NatsConfig",
    "OllamaConfig",
    "OllamaOptions",
    "Rate",
    "RetentionConfig",
    "RollbackConfig",
    "RouteConfig",
    "RouterConfig",
    "Secret",
    "SplitConfig",
    "TGIConfig",
    "TGIParameters",
    "WorkerConfig",
    "binding_groups",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_rate",
    "parse_size",
]

DEFAULT_PRIORITIES: Final = ("critical", "high", "normal", "low", "batch")

_NAME = r"^[A-Za-z0-9_-]{1,64}$"
Name = Annotated[str, Meta(pattern=_NAME)]
Duration = Annotated[str, Meta(pattern=r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)\s*$")]
#: The rate-limit header dialect a backend speaks (``renqueue.backends._limits``);
#: ``auto`` reads every dialect it finds.
LimitStyle = Literal[
    "auto", "openai", "groq", "cerebras", "openrouter", "anthropic", "gemini", "ietf"
]
InboxPrefix = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*(?!\n)$")]

_DURATION_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_WINDOW_WORDS: Final = {
    "sec": 1.0,
    "second": 1.0,
    "min": 60.0,
    "minute": 60.0,
    "hour": 3600.0,
    "day": 86400.0,
}
_DURATION_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_RATE_RE: Final = re.compile(r"^\s*(\d+)\s*/\s*(\S+)\s*$")


def parse_duration(text: str) -> float:
    """``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``, ``"7d"`` -> seconds."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}: use a number and ms, s, m, h or d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


#: The longest window a declared limit may have (the quota's spend log keeps 49 h).
_LONGEST_LIMIT_WINDOW: Final = 2 * 86_400.0


class Rate(Struct, frozen=True, kw_only=True):
    """``count`` per ``window`` seconds."""

    count: int
    window: float


def parse_rate(text: str) -> Rate:
    """``"30/min"``, ``"30/1m"``, ``"14400/day"``, ``"6000/10s"`` -> :class:`Rate`."""
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid rate {text!r}: use COUNT/WINDOW, e.g. 30/min or 1000/1d")
    count, window_text = int(match.group(1)), match.group(2)
    window = _WINDOW_WORDS.get(window_text)
    if window is None:
        window = parse_duration(window_text)
    if count < 1 or window <= 0:
        raise ValueError(f"invalid rate {text!r}: count and window must be positive")
    return Rate(count=count, window=window)


class Secret:
    """A credential. Never shows its value in repr, str, logs or errors."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self._value)


class _Section(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: unknown keys are errors (typos fail loudly)."""


_SIZE_UNITS: Final = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
#: A size in bytes: a number, or text with a unit as nats-server reads it
#: (``"512MB"``, ``"16GB"``, ``"1.5G"``; K, M, G and T are powers of 1024).
ByteSize = Annotated[int, Meta(ge=-1)] | Annotated[str, Meta(pattern=_SIZE_RE.pattern)]


def parse_size(value: int | str) -> int:
    """``16GB`` -> bytes (powers of 1024, as nats-server counts); an int is bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"invalid size {value!r}: use a number of bytes or e.g. 512MB, 16GB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _bounded(max_bytes: int | str | None) -> None:
    """Refuse a store with no byte limit (``-1``): every store is bounded
    (issue 30 item 4), or one store fills the server's whole store and then
    every write fails, the services' too (docs/operations.md#storage)."""
    if max_bytes is not None and parse_size(max_bytes) < 0:
        raise ValueError(
            f"max_bytes = {max_bytes!r} (no limit) is refused: every store must be "
            "bounded, or it can fill the server's whole store and stop every write "
            "(docs/operations.md#storage); give a size such as 2GB, or leave it unset "
            "for its share of nats.max_file_store"
        )


class RetentionConfig(_Section, frozen=True, kw_only=True):
    """Limits of one stream. ``max_age = "0s"`` means no age limit.

    ``max_bytes``: a size (bytes, or ``"512MB"``); unset: the stream's share
    of ``nats.max_file_store`` (:data:`STORE_SHARES`). No limit (``-1``) is
    refused: every store is bounded.
    """

    max_age: Duration = "0s"
    max_bytes: ByteSize | None = None

    @property
    def max_age_seconds(self) -> float:
        return parse_duration(self.max_age)

    def __post_init__(self) -> None:
        _bounded(self.max_bytes)


class BucketConfig(_Section, frozen=True, kw_only=True):
    """The byte limit of a KV bucket or a stream with no age setting of its own
    (``max_bytes`` as in :class:`RetentionConfig`)."""

    max_bytes: ByteSize | None = None

    def __post_init__(self) -> None:
        _bounded(self.max_bytes)


#: Each store's default ``max_bytes``, as a share of ``nats.max_file_store``
#: (by its ``[nats.<name>]`` table): sized by what a request leaves in each at
#: the default ages (docs/operations.md#storage). They add up to 98 %; the
#: leases' bucket takes :data:`LEASE_BYTES` besides.
STORE_SHARES: Final = {
    "requests": 0.10,
    "dispatch": 0.05,
    "events": 0.40,
    "cancels": 0.01,
    "tokens": 0.15,
    "dlq": 0.10,
    "claims": 0.12,
    "state": 0.03,
    "advisories": 0.02,
}
#: The leases' bucket (``rq-leases``): one small key per binder.
LEASE_BYTES: Final = 32 * 1024


class NatsConfig(_Section, frozen=True, kw_only=True):
    """Where NATS is. An empty ``url`` starts the embedded server."""

    url: str = ""
    data_dir: str = ".renqueue"
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=-1, le=65535)] = 4222
    replicas: Annotated[int, Meta(ge=1, le=5)] = 1
    duplicate_window: Duration = "10m"
    #: The JetStream store's size: the embedded server's ``max_file_store``
    #: (an external server's should be at least this), and what each store's
    #: default ``max_bytes`` is a share of (:data:`STORE_SHARES`).
    max_file_store: ByteSize = "16GB"
    #: ``renqueue status`` warns when a store is this full (a fraction).
    store_warn: Annotated[float, Meta(gt=0, le=1)] = 0.8
    requests: RetentionConfig = RetentionConfig()
    dispatch: RetentionConfig = RetentionConfig()
    events: RetentionConfig = RetentionConfig(max_age="30d")
    #: Clients' cancellations (``RQ_CANCELS``), kept until the event log has
    #: sourced them (at once, unless the log is full: then for ``max_age``).
    cancels: RetentionConfig = RetentionConfig(max_age="1d")
    tokens: RetentionConfig = RetentionConfig(max_age="1h")
    dlq: RetentionConfig = RetentionConfig(max_age="30d")
    #: The terminal claims' bucket (``rq-terminal``; its age is ``events.max_age``).
    claims: BucketConfig = BucketConfig()
    #: The projection's bucket (``rq-state``).
    state: BucketConfig = BucketConfig()
    #: The captured max-deliveries advisories (``RQ_ADVISORIES``).
    advisories: BucketConfig = BucketConfig()
    credentials_file: str | None = None
    ping_interval: Duration = "10s"
    #: Inbox prefix of this connection's replies. Under per-user permissions
    #: it must be one the user may subscribe to (``_INBOX_<user>`` in
    #: nats/auth.conf), or JetStream acks are denied. ``None``: ``_INBOX``.
    inbox_prefix: InboxPrefix | None = None
    #: How long a starting service waits for JetStream to answer (a cluster
    #: electing its leaders, nodes still joining) before it exits with an
    #: error; each start-up step waits this long at most. ``"0s"``: forever.
    startup_wait: Duration = "0s"
    #: How long a running service stays up while it cannot reach any NATS
    #: server (nats-py reconnecting, or a new connection failing), or one of
    #: its loops gets no answer on a live one, before it exits, saying why,
    #: for its process supervisor to restart it. ``"0s"``: forever.
    patience: Duration = "5m"

    @property
    def patience_seconds(self) -> float:
        """``patience`` in seconds; ``math.inf`` for ``"0s"`` (forever)."""
        return parse_duration(self.patience) or math.inf

    @property
    def store_bytes(self) -> int:
        """``max_file_store`` in bytes."""
        return parse_size(self.max_file_store)

    def max_bytes(self, store: str) -> int:
        """The ``max_bytes`` of ``store`` (a key of :data:`STORE_SHARES`): its
        own setting, else its share of ``max_file_store``."""
        limits: RetentionConfig | BucketConfig = getattr(self, store)
        if limits.max_bytes is not None:
            return parse_size(limits.max_bytes)
        return max(1, int(self.store_bytes * STORE_SHARES[store]))

    def __post_init__(self) -> None:
        if self.store_bytes < 0:
            raise ValueError(
                f"max_file_store = {self.max_file_store!r} (no limit) is refused: the "
                "JetStream store must be bounded, and every store's default max_bytes is a "
                "share of it (docs/operations.md#storage); give a size such as 16GB"
            )
        if self.store_bytes < 1024 * 1024:
            raise ValueError(f"max_file_store must be at least 1MB, not {self.max_file_store!r}")
        for store in STORE_SHARES:
            if self.max_bytes(store) == 0:
                # JetStream reads a max_bytes of 0 as no limit at all.
                raise ValueError(
                    f"{store}.max_bytes is 0 bytes ({getattr(self, store).max_bytes!r}), which "
                    "JetStream would read as no limit: give a size"
                )
        reserved = LEASE_BYTES + sum(self.max_bytes(s) for s in STORE_SHARES)
        if reserved > self.store_bytes:
            raise ValueError(
                f"the stores' max_bytes add up to {reserved} bytes, over max_file_store "
                f"({self.max_file_store}): JetStream would refuse to create them"
            )


class LimitsConfig(_Section, frozen=True, kw_only=True):
    """Declared limits of one backend: concurrent requests, and counts per window."""

    concurrency: Annotated[int, Meta(ge=1, le=100_000)] = 4
    requests: list[str] = []
    tokens: list[str] = []
    #: How windows of a day or longer reset: ``rolling`` (any stretch of the
    #: window), or at midnight ``utc`` or ``us-pacific`` (as daily free tiers do).
    daily_reset: Literal["rolling", "utc", "us-pacific"] = "rolling"

    def __post_init__(self) -> None:
        for text in (*self.requests, *self.tokens):
            rate = parse_rate(text)
            if rate.window > _LONGEST_LIMIT_WINDOW:
                # The spend log quotas are judged by keeps 49 hours.
                raise ValueError(
                    f"invalid rate {text!r}: windows longer than 2 days are not supported"
                )

    @property
    def request_rates(self) -> list[Rate]:
        return [parse_rate(text) for text in self.requests]

    @property
    def token_rates(self) -> list[Rate]:
        return [parse_rate(text) for text in self.tokens]

    def declared(self) -> tuple[Limit, ...]:
        """The declared request and token limits, as the quota rules take them."""
        return limits_of(
            [(rate.count, rate.window) for rate in self.request_rates],
            [(rate.count, rate.window) for rate in self.token_rates],
            self.daily_reset,
        )


class CircuitConfig(_Section, frozen=True, kw_only=True):
    """A backend's circuit breaker (``[backends.<name>.circuit]``).

    It opens after ``failures`` backend faults in a row, or when at least
    ``error_rate`` of at least ``min_calls`` calls ended in a backend fault
    within the last ``window``; after ``cooloff`` it lets one call through
    (half-open), which closes it again or opens it for another ``cooloff``.
    """

    failures: Annotated[int, Meta(ge=1, le=1000)] = 5
    error_rate: Annotated[float, Meta(gt=0, le=1)] = 0.5
    min_calls: Annotated[int, Meta(ge=1, le=100_000)] = 10
    window: Duration = "60s"
    cooloff: Duration = "30s"

    def __post_init__(self) -> None:
        window = parse_duration(self.window)
        if not 1 <= window <= 600:
            raise ValueError(f"circuit window must be between 1s and 10m, not {self.window!r}")
        if parse_duration(self.cooloff) <= 0:
            raise ValueError("circuit cooloff must be positive")


class ProbeConfig(_Section, frozen=True, kw_only=True):
    """An active health check of a backend (``[backends.<name>.probe]``), for
    local servers: ``GET <path>`` at the server's origin (``/health``: vLLM,
    TGI, llama.cpp; ``/v1/models``: any OpenAI-compatible server) every
    ``interval``; a 2xx within ``timeout`` is up."""

    path: str = "/health"
    interval: Duration = "5s"
    timeout: Duration = "2s"

    def __post_init__(self) -> None:
        if not self.path.startswith("/"):
            raise ValueError(f"probe path must start with '/', not {self.path!r}")
        if parse_duration(self.interval) < 0.05:
            raise ValueError("probe interval must be at least 50ms")


class BaseBackendConfig(_Section, frozen=True, kw_only=True, tag_field="adapter"):
    """One callable endpoint + model + credentials: what every adapter's config has.

    The ``adapter`` key picks the wire format, and with it the config class
    (a msgspec tagged union, :data:`AnyBackendConfig`): each adds its own
    options, so an option of another adapter is an unknown key, an error
    naming its path. No ``adapter`` key means ``"openai"``.
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    api_key_file: str | None = None
    tier: Annotated[int, Meta(ge=0, le=100)] = 1
    cost_input_per_mtok: Annotated[float, Meta(ge=0)] = 0.0
    cost_output_per_mtok: Annotated[float, Meta(ge=0)] = 0.0
    tags: list[str] = []
    limits: LimitsConfig = LimitsConfig()
    #: The longest silence from the backend during a call (between two reads).
    timeout: Duration = "120s"
    connect_timeout: Duration = "5s"
    #: The longest wait for the first token (from the call's start); unset: ``timeout``.
    first_token_timeout: Duration | None = None
    #: The longest a whole call may take; unset: no limit but the request's deadline.
    total_timeout: Duration | None = None
    #: How long a preempted call's slot stays taken after its stream is closed,
    #: for a server that refuses calls past its concurrency (429, 503) and notices
    #: a closed stream only at its next write; "0s": released at once.
    preempt_grace: Duration = "0s"
    #: The model's context window in tokens (prompt + output), when known: a
    #: request that failed for its context length falls back only to
    #: candidates with a larger declared window.
    context_window: Annotated[int, Meta(ge=1)] | None = None
    #: When to stop sending it requests for a while (the circuit breaker).
    circuit: CircuitConfig = CircuitConfig()
    #: An active health check, for local servers (``/health``, ``/v1/models``).
    probe: ProbeConfig | None = None
    #: Replicas of one model share a pool name: an idle one takes work
    #: queued on a busy sibling's subject (work stealing).
    pool: Name | None = None
    #: A backend whose key is missing is taken out of service at start-up
    #: with a warning, and the rest runs; a required one stops the start-up.
    required: bool = False
    #: What the model can do beyond text (``tools``, ``vision``, ``json``,
    #: ``json_schema``, ``logprobs``): requests that need a feature are routed
    #: only to backends that have it. Unset: all its adapter can translate
    #: (:attr:`ADAPTER_FEATURES`); narrow it for a model that lacks some
    #: (a text-only local model: ``features = ["tools"]``).
    features: list[Feature] | None = None
    #: What the adapter can translate to its provider's wire format.
    ADAPTER_FEATURES: ClassVar[frozenset[str]] = ALL_FEATURES

    @property
    def supports(self) -> frozenset[str]:
        """The features requests may need of it (``features``, else its adapter's)."""
        return self.ADAPTER_FEATURES if self.features is None else frozenset(self.features)

    @property
    def adapter(self) -> str:
        """The wire format (the tag of the config's class): ``openai``, ``anthropic``, ..."""
        return str(self.__struct_config__.tag)

    def __post_init__(self) -> None:
        if self.features is not None:
            beyond = [f for f in self.features if f not in self.ADAPTER_FEATURES]
            if beyond:
                raise ValueError(
                    f"the {self.adapter} adapter cannot send {', '.join(beyond)} "
                    f"(it can: {', '.join(sorted(self.ADAPTER_FEATURES)) or 'none of them'})"
                )
        if "@" in urllib.parse.urlsplit(self.base_url).netloc:
            # Never echoed: it holds a password. aiohttp refuses a URL's credentials
            # next to the key's header, and a URL reaches logs and error messages.
            raise ValueError(
                "base_url must not carry credentials (user:password@): give the key "
                "in api_key_env or api_key_file"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give api_key_env or api_key_file, not both")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """US dollars for a call with these token counts."""
        return (
            prompt_tokens * self.cost_input_per_mtok + completion_tokens * self.cost_output_per_mtok
        ) / 1_000_000

    def api_key(self, *, path: str = "$") -> Secret | None:
        """Read the key from its env var or file; ``None`` when the backend needs none.

        ``path`` is this backend's place in the config (``$.backends.<name>``),
        for the error.
        """
        if self.api_key_env is not None:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ConfigError(
                    f"environment variable {self.api_key_env} is not set",
                    path=f"{path}.api_key_env",
                )
            return Secret(value)
        if self.api_key_file is not None:
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(
                    f"cannot read key file: {exc.strerror}", path=f"{path}.api_key_file"
                ) from exc
            if not key:
                raise ConfigError("key file is empty", path=f"{path}.api_key_file")
            return Secret(key)
        return None


class BackendConfig(BaseBackendConfig, frozen=True, kw_only=True, tag="openai"):
    """A backend speaking the OpenAI chat-completions API (``adapter = "openai"``,
    the default): vLLM, Ollama's ``/v1``, llama.cpp, LM Studio, TGI's Messages
    API, Groq, OpenRouter, Together, Cerebras, the Hugging Face router, OpenAI."""

    #: Send the request's effective priority rank as the body's ``priority``
    #: field (vLLM's priority scheduling: lower runs sooner). Most other
    #: servers reject unknown fields, hence off by default.
    send_priority: bool = False
    #: The dialect its rate-limit headers and 429 bodies are read in
    #: (docs/rate-limits.md). ``auto`` reads every dialect it finds; name
    #: ``groq`` for Groq, whose request headers count per day.
    limit_style: LimitStyle = "auto"
    #: The pass-through parameters (a request's ``params.extra``, e.g. vLLM's
    #: ``top_k``) it is sent; others are left out. Unset: every one not
    #: reserved (``RESERVED_EXTRA``, refused at admission).
    extra_params: list[Annotated[str, Meta(max_length=128)]] | None = None


class AnthropicConfig(BaseBackendConfig, frozen=True, kw_only=True, tag="anthropic"):
    """A backend speaking Anthropic's Messages API (``adapter = "anthropic"``):
    ``POST {base_url}/messages``, the key in ``x-api-key``."""

    ADAPTER_FEATURES: ClassVar[frozenset[str]] = frozenset({"tools", "vision", "image_urls"})

    base_url: str = "https://api.anthropic.com/v1"
    #: The ``anthropic-version`` header.
    anthropic_version: Annotated[str, Meta(pattern=r"^[0-9A-Za-z._-]{1,64}(?!\n)$")] = "2023-06-01"
    #: Output tokens asked for when the request sets no ``max_tokens``
    #: (the Messages API requires one).
    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 4096
    #: ``anthropic-beta`` header values (beta features), joined with commas.
    beta: list[Annotated[str, Meta(pattern=r"^[0-9A-Za-z._-]{1,128}(?!\n)$")]] = []


class OllamaOptions(_Section, frozen=True, kw_only=True, omit_defaults=True):
    """Ollama's model ``options`` (its Modelfile parameters) sent with every call;
    the request's own parameters (``max_tokens`` as ``num_predict``,
    ``temperature``, ``top_p``, ``stop``, ``seed``) take precedence."""

    num_ctx: Annotated[int, Meta(ge=1)] | None = None
    num_predict: Annotated[int, Meta(ge=-2)] | None = None
    num_keep: Annotated[int, Meta(ge=-1)] | None = None
    num_batch: Annotated[int, Meta(ge=1)] | None = None
    num_gpu: Annotated[int, Meta(ge=-1)] | None = None
    num_thread: Annotated[int, Meta(ge=0)] | None = None
    main_gpu: Annotated[int, Meta(ge=0)] | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    typical_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_last_n: Annotated[int, Meta(ge=-1)] | None = None
    repeat_penalty: Annotated[float, Meta(ge=0)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: Annotated[float, Meta(ge=0)] | None = None
    mirostat_eta: Annotated[float, Meta(ge=0)] | None = None
    penalize_newline: bool | None = None
    seed: int | None = None
    stop: list[str] | None = None
    use_mmap: bool | None = None


#: Ollama's ``keep_alive``: a duration (``"5m"``, ``"1h"``, ``"-1m"``) or seconds
#: (``0`` unloads the model after the call, a negative number keeps it loaded).
KeepAlive = Annotated[str, Meta(pattern=r"^-?\d+(\.\d+)?(ms|s|m|h)(?!\n)$")] | int


class OllamaConfig(BaseBackendConfig, frozen=True, kw_only=True, tag="ollama"):
    """A backend speaking Ollama's native API (``adapter = "ollama"``):
    ``POST {base_url}/api/chat``, streamed as JSON lines."""

    ADAPTER_FEATURES: ClassVar[frozenset[str]] = frozenset(
        {"tools", "vision", "json", "json_schema"}
    )

    base_url: str = "http://127.0.0.1:11434"
    #: How long the model stays loaded after a call; unset: the server's default (5 min).
    keep_alive: KeepAlive | None = None
    options: OllamaOptions = OllamaOptions()


class TGIParameters(_Section, frozen=True, kw_only=True, omit_defaults=True):
    """TGI's generation ``parameters`` sent with every call; the request's own
    (``max_tokens`` as ``max_new_tokens``, ``temperature``, ``top_p``,
    ``stop``, ``seed``) take precedence."""

    max_new_tokens: Annotated[int, Meta(ge=1)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    top_p: Annotated[float, Meta(gt=0, lt=1)] | None = None
    typical_p: Annotated[float, Meta(gt=0, lt=1)] | None = None
    temperature: Annotated[float, Meta(gt=0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    frequency_penalty: float | None = None
    do_sample: bool | None = None
    truncate: Annotated[int, Meta(ge=1)] | None = None
    watermark: bool | None = None


class TGIConfig(BaseBackendConfig, frozen=True, kw_only=True, tag="tgi"):
    """A backend speaking Hugging Face Text Generation Inference's own API
    (``adapter = "tgi"``): ``POST {base_url}/generate_stream``, one prompt
    rendered from the chat in ``prompt_format``. (TGI's Messages API,
    ``/v1/chat/completions``, is the ``openai`` adapter.)"""

    ADAPTER_FEATURES: ClassVar[frozenset[str]] = frozenset({"json", "json_schema"})

    #: How the chat becomes one prompt: ``chatml`` (``<|im_start|>`` turns),
    #: ``llama3`` (``<|start_header_id|>`` turns), ``plain`` (the messages'
    #: text, a blank line apart: base models).
    prompt_format: Literal["chatml", "llama3", "plain"] = "chatml"
    parameters: TGIParameters = TGIParameters()


class GeminiSafetySetting(_Section, frozen=True, kw_only=True):
    """One of Gemini's ``safetySettings``: a harm category and its blocking threshold."""

    category: Annotated[str, Meta(pattern=r"^HARM_CATEGORY_[A-Z_]{1,64}(?!\n)$")]
    threshold: Literal[
        "HARM_BLOCK_THRESHOLD_UNSPECIFIED",
        "BLOCK_LOW_AND_ABOVE",
        "BLOCK_MEDIUM_AND_ABOVE",
        "BLOCK_ONLY_HIGH",
        "BLOCK_NONE",
        "OFF",
    ]


class GeminiConfig(BaseBackendConfig, frozen=True, kw_only=True, tag="gemini"):
    """A backend speaking the Gemini API (``adapter = "gemini"``):
    ``POST {base_url}/models/{model}:streamGenerateContent?alt=sse``, the key
    in ``x-goog-api-key``."""

    ADAPTER_FEATURES: ClassVar[frozenset[str]] = frozenset(
        {"tools", "vision", "image_urls", "json", "json_schema"}
    )

    base_url: str = "https://generativelanguage.googleapis.com/v1beta"
    #: ``generationConfig.topK``; unset: the model's default.
    top_k: Annotated[int, Meta(ge=1)] | None = None
    safety_settings: list[GeminiSafetySetting] = []


#: Every backend config, told apart by ``adapter`` (a msgspec tagged union).
AnyBackendConfig = BackendConfig | AnthropicConfig | OllamaConfig | TGIConfig | GeminiConfig
#: The adapters, for messages.
ADAPTERS: Final = ("openai", "anthropic", "ollama", "tgi", "gemini")
#: Every key some adapter's backend table takes.
_ADAPTER_OPTIONS: Final = frozenset(
    f.encode_name
    for config in (BackendConfig, AnthropicConfig, OllamaConfig, TGIConfig, GeminiConfig)
    for f in msgspec.structs.fields(config)
)


class FallbackConfig(_Section, frozen=True, kw_only=True):
    """How a route's requests fall back when a backend fails them
    (``[routes.<name>.fallback]``; see :func:`renqueue.policy.after_failure`)."""

    #: The failure classes that fall back (:class:`renqueue.errors.FailureClass`
    #: values); unset: all but ``bad_request`` and ``content_filter``; ``[]``:
    #: never fall back (retry on the bound backend, then fail).
    on: list[FailureClass] | None = None
    #: Backends a request may be tried on, the first included.
    attempts: Annotated[int, Meta(ge=1, le=100)] = 3
    #: Retries on the same backend of a transient failure before falling back.
    retries: Annotated[int, Meta(ge=0, le=20)] = 1
    #: A fallback may go to a lower tier than the backend that failed.
    downgrade: bool = True
    #: A fallback may go to a paid backend (within the request's ``max_cost``).
    paid: bool = True

    def policy(self) -> FallbackPolicy:
        return FallbackPolicy(
            on=DEFAULT_FALLBACK_ON if self.on is None else frozenset(self.on),
            attempts=self.attempts,
            retries=self.retries,
            downgrade=self.downgrade,
            paid=self.paid,
        )


class ComplexityConfig(_Section, frozen=True, kw_only=True):
    """A route's complexity estimator (``[routes.<name>.complexity]``): a request
    that names no ``complexity`` gets the tier its score reaches
    (:mod:`renqueue.policy._complexity`)."""

    #: Ascending scores in (0, 1]: reaching the n-th means tier n + 1.
    thresholds: Annotated[list[Annotated[float, Meta(gt=0, le=1)]], Meta(min_length=1)]
    #: The scorer: ``heuristic`` (no download; prompt length, requested output,
    #: code and math markers, conversation depth), or ``module.path:name``, a
    #: learned one (:func:`renqueue.policy.load_estimator`), loaded at start.
    estimator: Annotated[str, Meta(pattern=r"^(heuristic|[A-Za-z_][\w.]*:[A-Za-z_]\w*)(?!\n)$")] = (
        "heuristic"
    )

    def __post_init__(self) -> None:
        if list(self.thresholds) != sorted(self.thresholds):
            raise ValueError("complexity thresholds must be in ascending order")


#: A split's sticky key: the tenant, or a field of the request's ``metadata``.
SplitKey = Annotated[str, Meta(pattern=r"^(tenant|metadata\.[^\s]{1,64})(?!\n)$")]


class RollbackConfig(_Section, frozen=True, kw_only=True):
    """When the binder moves all of a split's traffic back to its control arm
    (``[routes.<name>.ab.rollback]``; :func:`renqueue.policy.breach`): an arm
    other than the control breaches when, over the last ``window``, at least
    ``min_requests`` of its requests ended and ``error_rate`` of them failed or
    expired, or at least ``min_requests`` completed with a p95 latency (or time
    to first token) above ``p95_latency`` (``p95_ttft``), both measured from
    the request's submission."""

    error_rate: Annotated[float, Meta(gt=0, le=1)] | None = None
    p95_latency: Duration | None = None
    p95_ttft: Duration | None = None
    min_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 20
    window: Duration = "5m"

    def __post_init__(self) -> None:
        if self.error_rate is None and self.p95_latency is None and self.p95_ttft is None:
            raise ValueError("give at least one of error_rate, p95_latency, p95_ttft")
        for name, value in (("p95_latency", self.p95_latency), ("p95_ttft", self.p95_ttft)):
            if value is not None and parse_duration(value) <= 0:
                raise ValueError(f"{name} must be above 0 (0 would roll back on any traffic)")
        window = parse_duration(self.window)
        if not AB_BUCKET <= window <= AB_HORIZON:
            raise ValueError(
                f"rollback window must be between {AB_BUCKET}s and {AB_HORIZON // 60}m,"
                f" not {self.window!r}"
            )

    def rules(self) -> RollbackRules:
        return RollbackRules(
            error_rate=self.error_rate,
            p95_latency=None if self.p95_latency is None else parse_duration(self.p95_latency),
            p95_ttft=None if self.p95_ttft is None else parse_duration(self.p95_ttft),
            min_requests=self.min_requests,
            window=parse_duration(self.window),
        )


class SplitConfig(_Section, frozen=True, kw_only=True):
    """A route's A/B split (``[routes.<name>.ab]``; :mod:`renqueue.policy._ab`).

    Each arm is a route's name (the route itself may be one: its own
    backends), with a weight; ``control`` is the arm all traffic goes back
    to on a rollback. A request keeps its arm by ``key``: its tenant, or a
    ``metadata`` field (``"metadata.user"``), hashed with the tenant; a
    request without that field is placed by its id (not sticky). ``salt``
    reshuffles which keys land where (a new experiment on the same arms).
    """

    arms: Annotated[dict[Name, float], Meta(min_length=1)]
    control: Name
    key: SplitKey = "tenant"
    salt: Annotated[str, Meta(max_length=64)] = ""
    #: Roll back automatically when an arm breaches these; unset: never automatically.
    rollback: RollbackConfig | None = None

    def __post_init__(self) -> None:
        for arm, weight in self.arms.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"arm {arm!r}: a weight is a finite number >= 0, not {weight}")
        total = sum(self.arms.values())
        if total <= 0:
            raise ValueError("the arms' weights sum to 0: no arm would get traffic")
        if not math.isfinite(total):
            raise ValueError("the arms' weights sum past what a float holds: use smaller ones")
        if self.control not in self.arms:
            raise ValueError(f"control {self.control!r} is not one of the arms")

    def policy(self, route: str) -> SplitPolicy:
        """The split of route ``route``, as the binder applies it."""
        return SplitPolicy(
            route=route,
            arms=tuple(self.arms.items()),
            control=self.control,
            key=self.key,
            salt=self.salt,
            rollback=None if self.rollback is None else self.rollback.rules(),
        )


class RouteConfig(_Section, frozen=True, kw_only=True):
    """A model group: candidate backends in cascade order (first = preferred)."""

    backends: Annotated[list[Name], Meta(min_length=1)]
    fallback: FallbackConfig = FallbackConfig()
    #: Estimate the tier of requests that name none; unset: they need none.
    complexity: ComplexityConfig | None = None
    #: ``cheapest``: bind the cheapest candidate predicted to finish before the
    #: request's deadline (waiting for a free one when it has the time);
    #: ``cascade``: the first candidate with room, in order.
    strategy: Literal["cheapest", "cascade"] = "cheapest"
    #: Among equally cheap candidates in time, prefer the one predicted to
    #: finish first (off: the cascade's order decides).
    adapt: bool = False
    #: With ``adapt``, the share of requests that choose among those by a draw
    #: from each one's spread (Thompson sampling), to keep estimates fresh.
    explore: Annotated[float, Meta(ge=0, le=1)] = 0.0
    #: Standard deviations of caution in a predicted finish time.
    spread: Annotated[float, Meta(ge=0, le=10)] = 1.0
    #: Split its traffic between routes (arms) by weight; unset: no split.
    ab: SplitConfig | None = None
    #: The binding group this route is bound in (docs/scaling.md): routes
    #: naming one group are bound by one binder even when they share no
    #: backend (groups are merged, never split). Unset: its connected
    #: component of routes and backends is its group.
    group: Name | None = None

    def rules(self) -> RouteRules:
        """How the planner chooses among this route's candidates."""
        return RouteRules(
            strategy=self.strategy, adapt=self.adapt, explore=self.explore, spread=self.spread
        )


class TenantConfig(_Section, frozen=True, kw_only=True):
    """A tenant's settings (``[tenants.<name>]``; ``[tenants."*"]``: every
    tenant not named). See :mod:`renqueue.policy._budget`."""

    #: US dollars per UTC day, judged against the projected spend; unset: no budget.
    daily_budget: Annotated[float, Meta(ge=0)] | None = None
    #: Past the budget: ``soft``, free and local backends only; ``hard``, new
    #: requests are also refused (``budget_exhausted``) until 00:00 UTC.
    budget: Literal["soft", "hard"] = "soft"
    #: The most urgent level its requests may be submitted at (a level name);
    #: a more urgent one is rejected ``priority_not_allowed``. Unset: any.
    #: (Aging and inheritance from its own parents may still raise a request
    #: above it while it waits.)
    max_priority: Name | None = None


class LevelConfig(_Section, frozen=True, kw_only=True):
    """Settings of one priority level (``[levels.<name>]``); unset = the default.

    Defaults for the standard levels: ``high`` ages after 30 s, ``normal`` 60 s,
    ``low`` 120 s, ``batch`` 300 s, each to the next more urgent level; ``low``
    and ``batch`` are preemptible; ``critical`` preempts. Other level names age
    after 60 s (all but the most urgent) and neither preempt nor are preempted.
    """

    age_after: Duration | None = None
    never_age: bool = False
    promote_to: Name | None = None
    preemptible: bool | None = None
    preempts: bool | None = None
    #: How long a request at this level with no deadline may wait for a free
    #: or cheaper backend rather than pay now (unset: it does not wait).
    patience: Duration | None = None


_LEVEL_DEFAULTS: Final = {
    "critical": LevelConfig(preempts=True),
    "high": LevelConfig(age_after="30s"),
    "normal": LevelConfig(age_after="60s"),
    "low": LevelConfig(age_after="120s", preemptible=True),
    "batch": LevelConfig(age_after="300s", preemptible=True),
}


class RouterConfig(_Section, frozen=True, kw_only=True):
    """Router tuning. ``hold_limit`` bounds requests a router holds while waiting for room."""

    fetch_batch: Annotated[int, Meta(ge=1, le=1000)] = 64
    hold_limit: Annotated[int, Meta(ge=1, le=100_000)] = 256
    capacity_refresh: Duration = "50ms"
    ack_wait: Duration = "30s"
    max_deliver: Annotated[int, Meta(ge=1)] = 10
    #: Requests one tenant may have waiting to be routed at one level (the
    #: requests stream's ``max_msgs_per_subject``: a level's subject is per
    #: tenant); past it the broker refuses the submit
    #: (:class:`~renqueue.errors.TenantBacklogFullError`), so one tenant's flood
    #: puts at most this many of its requests ahead of another's. 0: no cap.
    tenant_backlog: Annotated[int, Meta(ge=0)] = 0
    #: A coalescing group expires this long after its last change (a join, a
    #: follower leaving, its leader ending); ``"0s"``: never.
    coalesce_ttl: Duration = "1h"
    #: The binder's lease (renqueue.coordination._lease): a dead binder's standby takes
    #: over about this long (plus ~0.3 s of server expiry) after it died.
    lease_ttl: Duration = "1s"
    #: Split binding in groups (docs/scaling.md): routes sharing no backend are
    #: bound by binders of their own, one lease each. Off: one binder for all.
    split_binding: bool = False
    #: Bind to a backend only while a worker asks it for work (its consumer has
    #: a pull waiting): one with no live worker (stopped, restarting, not yet
    #: started) counts as full, so its requests wait in the priority subjects or
    #: go to another backend of the route. ``false`` (the default, for now): bind
    #: up to its slots whatever; requests then wait in its queue until a worker comes.
    require_worker: bool = False

    def __post_init__(self) -> None:
        ttl = parse_duration(self.lease_ttl)
        if not 0.2 <= ttl <= 60:
            raise ValueError(f"lease_ttl must be between 200ms and 60s, not {self.lease_ttl!r}")


class WorkerConfig(_Section, frozen=True, kw_only=True):
    """Worker tuning.

    ``ack_wait`` is a running request's lease: renewed every third of it while
    the run is alive, so a dead worker's slots come back after at most this.
    ``max_deliver`` is the retry budget: runs of one dispatch that may fail
    (``retrying`` events: transient backend errors, worker errors) before the
    request fails; a run cut short by a broker that does not answer is handed
    back with a backoff and does not count. ``delivery_limit`` is the broker's backstop (the worker
    consumer's ``max_deliver``): deliveries of one dispatch for any reason,
    failed runs, dead workers and shutdowns alike, after which the request
    fails as ``undeliverable``; by default ``max(20, 4 * max_deliver)``, so
    restarts do not use up a request's budget. ``retry_delay`` and
    ``max_retry_delay`` shape the backoff between failed runs (doubling from
    the first, capped by the second, jittered: :func:`renqueue.policy.backoff`).
    ``quota_hold``: how long a backend whose provider says its quota is spent
    without saying until when (OpenAI ``insufficient_quota``) is left out, at
    least 1 s; the request that got that answer goes back to routing at once.
    """

    ack_wait: Duration = "5s"
    max_deliver: Annotated[int, Meta(ge=1)] = 5
    delivery_limit: Annotated[int, Meta(ge=2)] | None = None
    retry_delay: Duration = "1s"
    max_retry_delay: Duration = "30s"
    drain_timeout: Duration = "10s"
    quota_hold: Duration = "10m"

    def __post_init__(self) -> None:
        if self.delivery_limit is not None and self.delivery_limit <= self.max_deliver:
            raise ValueError(
                f"delivery_limit ({self.delivery_limit}) must exceed max_deliver "
                f"({self.max_deliver}): it is a backstop above the retry budget"
            )
        if parse_duration(self.max_retry_delay) < parse_duration(self.retry_delay):
            raise ValueError(
                f"max_retry_delay ({self.max_retry_delay}) must not be below retry_delay "
                f"({self.retry_delay}): it caps the backoff that starts there"
            )
        if parse_duration(self.quota_hold) < 1.0:
            raise ValueError(
                f"quota_hold ({self.quota_hold}) must be at least 1s: a backend whose "
                "quota is spent would be probed again (and the request put back) that often"
            )

    def failure_policy(self) -> FailurePolicy:
        """The rules a worker decides a failed run by (:func:`renqueue.policy.after_failure`)."""
        return FailurePolicy(
            budget=self.max_deliver,
            retry_delay=parse_duration(self.retry_delay),
            max_retry_delay=parse_duration(self.max_retry_delay),
            quota_hold=parse_duration(self.quota_hold),
        )

    @property
    def deliveries(self) -> int:
        """The worker consumer's ``max_deliver``: ``delivery_limit`` or its default."""
        if self.delivery_limit is not None:
            return self.delivery_limit
        return max(20, 4 * self.max_deliver)


class GatewayKey(_Section, frozen=True, kw_only=True):
    """One API key of the gateway (``[[gateway.keys]]``): the tenant it speaks
    for, and the SHA-256 of the key (64 hex digits), never the key itself
    (``renqueue gateway keygen TENANT`` makes a key and prints this entry)."""

    tenant: Name
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}(?!\n)$")]


class GatewayConfig(_Section, frozen=True, kw_only=True):
    """The OpenAI-compatible HTTP gateway (``renqueue gateway``; ``renqueue up``
    starts it too when it has API keys, unless ``enabled = false``). See
    docs/gateway.md."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    #: API keys by hash; more may come from ``keys_file`` (lines of
    #: ``sha256:<hex> <tenant>``, read when the gateway starts).
    keys: list[GatewayKey] = []
    keys_file: str | None = None
    #: The largest request body accepted, in bytes (413 beyond).
    max_body: Annotated[int, Meta(ge=1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024
    #: Requests one tenant may have waiting on this gateway process at once
    #: (429 beyond); 0: no limit.
    max_in_flight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    #: Calls one API key may have in progress on this gateway process at once,
    #: whatever the endpoint, a body still being sent included (429
    #: ``key_in_flight_limit`` beyond); 0: no limit.
    max_in_flight_per_key: Annotated[int, Meta(ge=0, le=1_000_000)] = 256
    #: From a request's first byte to the end of its headers (408
    #: ``header_timeout`` and the connection closed beyond): slowloris.
    header_timeout: Duration = "10s"
    #: From a request's headers to the end of its body (408 ``body_timeout``
    #: and the connection closed beyond): a body sent a byte at a time.
    body_timeout: Duration = "30s"
    #: A connection with no request in progress is closed after this long:
    #: one opened and never used, or kept alive between requests.
    idle_timeout: Duration = "75s"
    #: A client that lets the connection's send buffer stay full this long (it
    #: stopped reading its answer, or reads a trickle) is dropped, its call as
    #: a disconnect.
    send_timeout: Duration = "60s"
    #: How long this process remembers a request's body fingerprint, so that an
    #: SDK's retry of it (``x-stainless-retry-count`` above 0, no
    #: ``Idempotency-Key``) joins it; unset: ``nats.duplicate_window``.
    retry_memory: Duration | None = None
    #: The SHA-256 digests (64 hex digits) of the admin keys, which open the web
    #: console (``/console``; ``renqueue gateway keygen --admin`` makes one). No
    #: admin key: no console. An admin key speaks for no tenant.
    admin_keys: list[Annotated[str, Meta(pattern=r"^[0-9a-f]{64}(?!\n)$")]] = []

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "idle_timeout", "send_timeout"):
            seconds = parse_duration(getattr(self, name))
            if not 0.05 <= seconds <= 3600:
                raise ValueError(f"gateway {name} must be between 50ms and 1h, not {seconds}s")

    @property
    def timeouts(self) -> tuple[float, float, float]:
        """``header_timeout``, ``body_timeout`` and ``idle_timeout`` in seconds."""
        return (
            parse_duration(self.header_timeout),
            parse_duration(self.body_timeout),
            parse_duration(self.idle_timeout),
        )


class Config(_Section, frozen=True, kw_only=True):
    """The whole configuration (one TOML file)."""

    nats: NatsConfig = NatsConfig()
    priorities: Annotated[list[Name], Meta(min_length=1, max_length=16)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_PRIORITIES)
    )
    default_priority: Name = "normal"
    levels: dict[Name, LevelConfig] = {}
    backends: dict[Name, AnyBackendConfig] = {}
    routes: dict[Name, RouteConfig] = {}
    #: Per-tenant settings by name, ``"*"`` for every tenant not named.
    tenants: dict[str, TenantConfig] = {}
    router: RouterConfig = RouterConfig()
    worker: WorkerConfig = WorkerConfig()
    gateway: GatewayConfig = GatewayConfig()

    def unusable_backends(self, names: Iterable[str]) -> dict[str, ConfigError]:
        """Of ``names``, the backends whose credentials cannot be read, with why.

        Raises the error of the first *required* one (``required = true``).
        """
        unusable: dict[str, ConfigError] = {}
        for name in names:
            backend = self.backends[name]
            try:
                backend.api_key(path=f"$.backends.{name}")
            except ConfigError as exc:
                if backend.required:
                    raise
                unusable[name] = exc
        return unusable

    def without_backends(self, names: Iterable[str]) -> Config:
        """This config with ``names`` taken out of service: gone from every route,
        and routes left with no backend gone too."""
        out = set(names)
        routes = {
            name: msgspec.structs.replace(
                route, backends=[b for b in route.backends if b not in out]
            )
            for name, route in self.routes.items()
        }
        return msgspec.structs.replace(
            self,
            backends={n: b for n, b in self.backends.items() if n not in out},
            routes={n: r for n, r in routes.items() if r.backends},
        )

    def binding_groups(self) -> tuple[BindingGroup, ...]:
        """The binding groups (docs/scaling.md), by name: see :func:`binding_groups`."""
        return binding_groups(self)

    def sharded(self) -> bool:
        """Whether binding is split over several groups (``router.split_binding``
        and more than one group): each a lease, a binder and request subjects that
        name the route (``rq.req.<level>.<tenant>.<route>``). Otherwise every
        subject, consumer and lease is the unsplit one."""
        return self.router.split_binding and len(self.binding_groups()) > 1

    def for_group(self, group: BindingGroup) -> Config:
        """This config as ``group``'s binder sees it: its routes and backends only,
        so no slot, quota, circuit or preemption is shared with another group."""
        routes = set(group.routes)
        backends = set(group.backends)
        return msgspec.structs.replace(
            self,
            routes={n: r for n, r in self.routes.items() if n in routes},
            backends={n: b for n, b in self.backends.items() if n in backends},
        )

    def highest_tier(self, route: str) -> int:
        """The highest tier among ``route``'s backends (0 when it has none)."""
        names = self.routes[route].backends if route in self.routes else []
        return max((self.backends[name].tier for name in names if name in self.backends), default=0)

    def candidates(self, route: str) -> tuple[Candidate, ...]:
        """The route's backends in cascade order, as the failure policy sees them."""
        names = self.routes[route].backends if route in self.routes else []
        return tuple(self.candidate(name) for name in names if name in self.backends)

    def candidate(self, name: str) -> Candidate:
        """One backend as the failure policy sees it."""
        backend = self.backends[name]
        return Candidate(
            name=name,
            tier=backend.tier,
            context_window=backend.context_window,
            paid=backend.cost_input_per_mtok > 0 or backend.cost_output_per_mtok > 0,
            features=backend.supports,
        )

    def serves(self, request: InferenceRequest, route: str) -> bool:
        """Whether ``route`` exists and can serve ``request`` (its complexity
        and cost cap, as admission checks them)."""
        if route not in self.routes:
            return False
        if request.complexity is not None and request.complexity > self.highest_tier(route):
            return False
        need = needs(request)
        if need and not any(
            need <= self.backends[name].supports
            for name in self.routes[route].backends
            if name in self.backends
        ):
            return False
        return request.max_cost is None or any(
            estimated_cost(request, self.backends[name]) <= request.max_cost
            for name in self.routes[route].backends
            if name in self.backends
        )

    def route_facts(
        self, request: InferenceRequest, backend: str, *, probe: bool, now: float
    ) -> RouteFacts | None:
        """``request``'s route and cascade state for the failure policy after a
        run on ``backend`` failed (``None``: its route or the backend is not in
        this config: no fallback)."""
        route = self.routes.get(request.route)
        if route is None or backend not in self.backends:
            return None
        candidates = self.candidates(request.route)
        if request.max_cost is not None:
            candidates = tuple(
                msgspec.structs.replace(c, cost=estimated_cost(request, self.backends[c.name]))
                for c in candidates
            )
        facts = RouteFacts(
            policy=route.fallback.policy(),
            candidates=candidates,
            backend=self.candidate(backend),
            probe=probe,
            now=now,
            complexity=request.complexity,
            max_cost=request.max_cost,
            needs=needs(request),
        )
        if request.fallback is None:  # a first run: the default, an empty Fallback
            return facts
        return msgspec.structs.replace(facts, fallback=request.fallback)

    def estimated(
        self, request: InferenceRequest, estimators: Mapping[str, Estimator]
    ) -> tuple[InferenceRequest, ComplexityEstimate | None]:
        """``request`` with the tier its route's estimator gives it (one of
        ``estimators``, :meth:`estimators`; else the heuristic), and that
        estimate; unchanged (``None``) when its route has no complexity rules
        or it named its own tier (its ``submitted`` event keeps its own word)."""
        rules = self.routes[request.route].complexity
        if rules is None or request.complexity is not None:
            return request, None
        highest = max(1, self.highest_tier(request.route))
        estimate = estimate_complexity(
            request,
            rules.thresholds,
            highest=highest,
            estimator=estimators.get(request.route),
        )
        return msgspec.structs.replace(request, complexity=estimate.tier), estimate

    def estimators(self) -> dict[str, Estimator]:
        """The learned complexity estimators the routes name, loaded (the
        heuristic is the default). Raises :class:`ConfigError` naming the key
        of one that cannot be used."""
        found: dict[str, Estimator] = {}
        for name, route in self.routes.items():
            if route.complexity is None:
                continue
            try:
                estimator = load_estimator(route.complexity.estimator)
            except (ValueError, TypeError) as exc:
                raise ConfigError(str(exc), path=f"$.routes.{name}.complexity.estimator") from exc
            if estimator is not None:
                found[name] = estimator
        return found

    def max_priority_of(self, tenant: str) -> str | None:
        """The most urgent level ``tenant`` may submit at (its own section's
        ``max_priority``, else ``[tenants."*"]``'s); ``None``: any."""
        found = self.tenants.get(tenant)
        settings = found if found is not None else self.tenants.get(EVERY_TENANT)
        return None if settings is None else settings.max_priority

    def priority_rank(self, level: str) -> int:
        """0 for the most urgent level."""
        return self.priorities.index(level)

    def plan_policy(self) -> PlanPolicy:
        """The rules a router plans its rounds by (:func:`renqueue.policy.plan`)."""
        return PlanPolicy(
            levels=tuple(self.level_policies()),
            routes={name: tuple(route.backends) for name, route in self.routes.items()},
            rules={name: route.rules() for name, route in self.routes.items()},
            budgets=self.budgets(),
        )

    def budgets(self) -> dict[str, Budget | None]:
        """Each named tenant's daily budget (``None``: named with none, so the
        ``"*"`` one does not apply to it; ``"*"``: every tenant not named)."""
        return {
            name: None
            if tenant.daily_budget is None
            else Budget(daily=tenant.daily_budget, mode=tenant.budget)
            for name, tenant in self.tenants.items()
        }

    def level_policies(self) -> list[LevelPolicy]:
        """Every level's effective settings, most urgent first (defaults filled in)."""
        policies = []
        for rank, name in enumerate(self.priorities):
            given = self.levels.get(name, LevelConfig())
            default = _LEVEL_DEFAULTS.get(name, LevelConfig(age_after=None if rank == 0 else "60s"))
            age = None if given.never_age else (given.age_after or default.age_after)
            policies.append(
                LevelPolicy(
                    name=name,
                    rank=rank,
                    age_after=None if rank == 0 or age is None else parse_duration(age),
                    promote_to=(
                        None if given.promote_to is None else self.priority_rank(given.promote_to)
                    ),
                    preemptible=bool(
                        default.preemptible if given.preemptible is None else given.preemptible
                    ),
                    preempts=bool(default.preempts if given.preempts is None else given.preempts),
                    patience=None if given.patience is None else parse_duration(given.patience),
                )
            )
        return policies


_S = TypeVar("_S")


#: msgspec's words for a key no field has.
_UNKNOWN_FIELD: Final = re.compile(r"^Object contains unknown field `(?P<key>.*)`$", re.DOTALL)
#: One step of msgspec's error path: ``.field``, ``[0]`` (a list), ``[...]`` (a table's value).
_PATH_STEP: Final = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _convert(
    value: Any, type_: type[_S], path: str, source: str | None, *, unknown_note: str = ""
) -> _S:
    """``value`` as ``type_``, or a :class:`ConfigError` at the offending field's path.

    An unknown key's error says "did you mean" when a known key of that table
    (or one below it) is close (:func:`_did_you_mean`); ``unknown_note``
    instead when the key is some adapter's option (another adapter's, then).
    """
    try:
        return msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `")
        where = where.rstrip("`")
        field = path + where[1:] if where else path
        unknown = _UNKNOWN_FIELD.match(message)
        if unknown is not None:
            # An option of another adapter's is named as such before any spelling guess.
            other = unknown_note if unknown["key"] in _ADAPTER_OPTIONS else ""
            message += other or _did_you_mean(
                unknown["key"], _tables_at(type_, value, where or "$")
            )
        raise ConfigError(message, path=field, source=source) from exc


def _did_you_mean(key: str, tables: list[msgspec.inspect.StructType]) -> str:
    """``; did you mean `<the closest known key>`?``, or "" when none is close.

    The keys of ``tables`` first, then those one table down (``limits.concurrency``
    for a ``concurency`` put in a backend's own table)."""
    here = sorted({f.encode_name for table in tables for f in table.fields})
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return f"; did you mean `{close[0]}`?"
    below = {
        f"{f.encode_name}.{g.encode_name}": g.encode_name
        for table in tables
        for f in table.fields
        for inner in _members(f.type, None)
        if isinstance(inner, msgspec.inspect.StructType)
        for g in inner.fields
    }
    close = difflib.get_close_matches(key, sorted(set(below.values())), n=1)
    if close:
        return f"; did you mean `{min(k for k, v in below.items() if v == close[0])}`?"
    return ""


def _tables_at(type_: Any, value: Any, where: str) -> list[msgspec.inspect.StructType]:
    """The tables (structs) ``where`` (msgspec's error path, from ``$``) names in
    ``type_``, walking ``value`` alongside to pick a tagged union's member."""
    found: list[tuple[msgspec.inspect.Type, Any]] = [(msgspec.inspect.type_info(type_), value)]
    for name, index in _PATH_STEP.findall(where):
        steps: list[tuple[msgspec.inspect.Type, Any]] = []
        for info, here in found:
            for one in _members(info, here):
                if name and isinstance(one, msgspec.inspect.StructType):
                    inner = here.get(name) if isinstance(here, Mapping) else None
                    steps += [(f.type, inner) for f in one.fields if f.encode_name == name]
                elif index == "..." and isinstance(one, msgspec.inspect.DictType):
                    steps.append((one.value_type, None))
                elif index.isdigit() and isinstance(
                    one, msgspec.inspect.ListType | msgspec.inspect.VarTupleType
                ):
                    items = here if isinstance(here, list) else []
                    steps.append(
                        (one.item_type, items[int(index)] if int(index) < len(items) else None)
                    )
        found = steps
    return [
        one
        for info, here in found
        for one in _members(info, here)
        if isinstance(one, msgspec.inspect.StructType)
    ]


def _members(info: msgspec.inspect.Type, value: Any) -> list[msgspec.inspect.Type]:
    """``info`` without its metadata, a union as its members (a tagged union's
    member named by ``value``'s tag only, when it names one)."""
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if not isinstance(info, msgspec.inspect.UnionType):
        return [info]
    members = [m.type if isinstance(m, msgspec.inspect.Metadata) else m for m in info.types]
    tagged: list[msgspec.inspect.Type] = [
        m
        for m in members
        if isinstance(m, msgspec.inspect.StructType)
        and m.tag_field is not None
        and isinstance(value, Mapping)
        and value.get(m.tag_field) == m.tag
    ]
    return tagged or members


def _convert_backend(value: Any, path: str, source: str | None) -> AnyBackendConfig:
    """One backend's table: its ``adapter`` (``"openai"`` when absent) picks its class."""
    if not isinstance(value, Mapping):
        raise ConfigError("expected a table", path=path, source=source)
    adapter = value.get("adapter", "openai")
    if adapter not in ADAPTERS:
        raise ConfigError(
            f"unknown adapter {adapter!r} (one of: {', '.join(ADAPTERS)})",
            path=f"{path}.adapter",
            source=source,
        )
    # An unknown key may be an option of another adapter: say which adapter this one is.
    return _convert(
        {"adapter": adapter, **value},
        AnyBackendConfig,  # type: ignore[arg-type]
        path,
        source,
        unknown_note=f": not an option of adapter {adapter!r}",
    )


def parse_config(data: Mapping[str, Any], *, source: str | None = None) -> Config:
    """Validate a config mapping (as read from TOML). Raises :class:`ConfigError`."""
    raw = dict(data)
    backends = raw.pop("backends", {})
    routes = raw.pop("routes", {})
    levels = raw.pop("levels", {})
    tenants = raw.pop("tenants", {})
    sections = (
        ("backends", backends),
        ("routes", routes),
        ("levels", levels),
        ("tenants", tenants),
    )
    for section, value in sections:
        if not isinstance(value, Mapping):
            raise ConfigError("expected a table", path=f"$.{section}", source=source)
    config = _convert(raw, Config, "$", source)
    parsed_backends = {
        name: _convert_backend(value, f"$.backends.{name}", source)
        for name, value in backends.items()
    }
    parsed_routes = {
        name: _convert(value, RouteConfig, f"$.routes.{name}", source)
        for name, value in routes.items()
    }
    parsed_levels = {
        name: _convert(value, LevelConfig, f"$.levels.{name}", source)
        for name, value in levels.items()
    }
    parsed_tenants = {
        name: _convert(value, TenantConfig, f"$.tenants.{name}", source)
        for name, value in tenants.items()
    }
    config = msgspec.structs.replace(
        config,
        backends=parsed_backends,
        routes=parsed_routes,
        levels=parsed_levels,
        tenants=parsed_tenants,
    )
    _check_references(config, source)
    return config


def _check_names(config: Config, source: str | None) -> None:
    name_re = re.compile(_NAME)
    for section, names in (("backends", config.backends), ("routes", config.routes)):
        for name in names:
            if not name_re.fullmatch(name):
                raise ConfigError(
                    f"invalid name {name!r}: use letters, digits, - and _",
                    path=f"$.{section}.{name}",
                    source=source,
                )
    for name in config.tenants:
        if name != EVERY_TENANT and not name_re.fullmatch(name):
            raise ConfigError(
                f'invalid tenant {name!r}: a tenant name (letters, digits, - and _) or "*"',
                path=f"$.tenants.{name}",
                source=source,
            )


def _check_references(config: Config, source: str | None) -> None:
    _check_names(config, source)
    for name, tenant in config.tenants.items():
        if tenant.max_priority is not None and tenant.max_priority not in config.priorities:
            raise ConfigError(
                f"{tenant.max_priority!r} is not one of the priority levels",
                path=f"$.tenants.{name}.max_priority",
                source=source,
            )
    if len(set(config.priorities)) != len(config.priorities):
        raise ConfigError("priority levels must be unique", path="$.priorities", source=source)
    for name, level in config.levels.items():
        if name not in config.priorities:
            raise ConfigError(
                f"{name!r} is not one of the priority levels",
                path=f"$.levels.{name}",
                source=source,
            )
        target = level.promote_to
        if target is not None and (
            target not in config.priorities
            or config.priority_rank(target) >= config.priority_rank(name)
        ):
            raise ConfigError(
                f"promote_to must name a more urgent level than {name!r}",
                path=f"$.levels.{name}.promote_to",
                source=source,
            )
    if config.default_priority not in config.priorities:
        raise ConfigError(
            f"{config.default_priority!r} is not one of the priority levels",
            path="$.default_priority",
            source=source,
        )
    for route_name, route in config.routes.items():
        for index, backend in enumerate(route.backends):
            if backend not in config.backends:
                raise ConfigError(
                    f"unknown backend {backend!r}",
                    path=f"$.routes.{route_name}.backends[{index}]",
                    source=source,
                )
        _check_split(config, route_name, source)
    _check_groups(config, source)


class BindingGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Routes bound in one place, and their candidate backends (docs/scaling.md)."""

    name: str
    routes: tuple[str, ...]
    backends: tuple[str, ...]


def binding_groups(config: Config) -> tuple[BindingGroup, ...]:
    """The binding groups of ``config``, by name. Pure.

    A group is a connected component of the graph of routes and backends, a
    route joined to each of its candidates and to the arms of its A/B split;
    routes naming one ``group`` are joined too (groups are merged, never split).
    A group is named by its routes' ``group``, else by its first route by name.
    Two groups share no backend, so no slot, quota, circuit or preemption.
    Raises :class:`ValueError` for routes of one component naming two groups,
    or a group's name that is another group's.
    """
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def join(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for name, route in config.routes.items():
        node = f"r:{name}"
        find(node)
        for backend in route.backends:
            join(node, f"b:{backend}")
        for arm in route.ab.arms if route.ab is not None else ():
            join(node, f"r:{arm}")
        if route.group is not None:
            join(node, f"g:{route.group}")
    members: dict[str, list[str]] = {}
    for name in sorted(config.routes):
        members.setdefault(find(f"r:{name}"), []).append(name)
    groups: list[BindingGroup] = []
    for routes in members.values():
        names = {g for r in routes if (g := config.routes[r].group) is not None}
        if len(names) > 1:
            raise ValueError(
                f"routes {', '.join(routes)} share backends (or an A/B split), so they are "
                f"one binding group, but name groups {', '.join(sorted(names))}: a group "
                "can be merged, never split"
            )
        backends = sorted({b for r in routes for b in config.routes[r].backends})
        name = names.pop() if names else routes[0]
        groups.append(BindingGroup(name=name, routes=tuple(routes), backends=tuple(backends)))
    groups.sort(key=lambda group: group.name)
    for first, second in itertools.pairwise(groups):
        if first.name == second.name:
            raise ValueError(
                f"two binding groups are named {first.name!r} (routes {', '.join(first.routes)};"
                f" {', '.join(second.routes)}): name one of them with `group`"
            )
    return tuple(groups)


def _check_groups(config: Config, source: str | None) -> None:
    try:
        groups = binding_groups(config)
    except ValueError as exc:
        raise ConfigError(str(exc), path="$.routes", source=source) from None
    if config.router.split_binding and len(groups) > 1 and "requeue" in config.routes:
        raise ConfigError(
            "a route may not be named 'requeue' when binding is split in groups: "
            "rq.req.<level>.<tenant>.requeue is the services' requeue subject",
            path="$.routes.requeue",
            source=source,
        )


def _check_split(config: Config, route_name: str, source: str | None) -> None:
    """Each arm of a route's split names a route, and none but the route
    itself splits again (a request is split once)."""
    split = config.routes[route_name].ab
    if split is None:
        return
    for arm in split.arms:
        path = f"$.routes.{route_name}.ab.arms.{arm}"
        target = config.routes.get(arm)
        if target is None:
            raise ConfigError(f"unknown route {arm!r}", path=path, source=source)
        if arm != route_name and target.ab is not None:
            raise ConfigError(
                f"route {arm!r} has an A/B split of its own: an arm must not split again",
                path=path,
                source=source,
            )


#: The largest config file read (bytes): a config is a few KiB; a file past
#: this (a log given by mistake, ``/dev/zero``) is refused, not read for ever.
MAX_CONFIG_BYTES: Final = 16 * 1024 * 1024


def read_toml(file: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML file (a config, a what-if file) as a table: at most
    :data:`MAX_CONFIG_BYTES` read; every way it can fail (unreadable, too
    large, not UTF-8, not TOML, nested too deeply) a :class:`ConfigError`
    naming the file."""
    source = str(file)
    try:
        with open(file, "rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"over {MAX_CONFIG_BYTES // (1024 * 1024)} MiB: not a config file", source=source
            )
        return tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError("file not found", source=source) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=source) from exc
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 (byte {exc.start}): TOML is UTF-8"
        raise ConfigError(why, source=source) from exc
    except RecursionError as exc:
        # tomllib parses nested arrays and inline tables by recursion.
        raise ConfigError("not valid TOML: nested too deeply", source=source) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=source) from exc


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load ``path`` (or ``$RENQUEUE_CONFIG``, or ``./renqueue.toml``), then env overrides.

    With no file at all, returns the defaults (no backends, no routes).
    """
    env = os.environ if environ is None else environ
    candidate = path or env.get("RENQUEUE_CONFIG")
    file = Path(candidate) if candidate else Path("renqueue.toml")
    source = str(file)
    if file.exists():
        data = read_toml(file)
    elif candidate:
        raise ConfigError("file not found", source=source)
    else:
        data, source = {}, "<defaults>"
    config = parse_config(data, source=source)
    nats = config.nats
    if url := env.get("RENQUEUE_NATS_URL"):
        nats = msgspec.structs.replace(nats, url=url)
    if data_dir := env.get("RENQUEUE_DATA_DIR"):
        nats = msgspec.structs.replace(nats, data_dir=data_dir)
    return msgspec.structs.replace(config, nats=nats)
