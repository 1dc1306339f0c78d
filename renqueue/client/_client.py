"""The :class:`Client`: submits a tenant's requests and hands out their handles.

It builds and validates a request (:meth:`Client.build_request`), publishes
it (:func:`._retries.publish`), and gives a :class:`~._handle.RequestHandle`
that its event tap (:mod:`._tap`) resolves when the request ends.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any, Self

import msgspec

from ..broker import Connection, NatsClient, connect, hop
from ..config import NatsConfig
from ..errors import MalformedRequestError
from ..lifecycle import Closing
from ..schema import (
    REQUEST_DECODER,
    ChatMessage,
    Event,
    GenerationParams,
    InferenceRequest,
    TraceParent,
)
from ._handle import RequestHandle
from ._retries import Published, publish
from ._tap import EventTap, Waiter

__all__ = ["Client"]


def _params(base: GenerationParams | None, **given: Any) -> GenerationParams:
    """``base`` (or the defaults) with the parameters ``given`` (not ``None``) in place."""
    changes = {name: value for name, value in given.items() if value is not None}
    if base is None:
        return GenerationParams(**changes)
    return msgspec.structs.replace(base, **changes) if changes else base


class Client(Closing):
    """Submits requests for one tenant. Create with :meth:`connect` or from an open connection."""

    #: Idle heartbeat of the event tap; three missed ones mean it is gone.
    tap_heartbeat: float = 5.0
    #: How long the server keeps the tap while no one listens (a disconnect).
    tap_inactive_threshold: float = 30.0
    #: Seconds a submit that finds no stream (a cluster electing a leader, or a
    #: level that is not configured) is retried before the requests stream's
    #: subjects are read: UnknownPriorityError if it lacks the level, else the
    #: submit goes on retrying (``submit_patience``).
    no_stream_grace: float = 3.0
    #: Seconds a submit keeps publishing a request again while the broker does
    #: not answer (less if its deadline comes first); then the last error is
    #: raised. Keep it well inside ``nats.duplicate_window`` (10 minutes): a
    #: retry past the window would store a second copy of a stored request.
    submit_patience: float = 30.0

    def __init__(
        self,
        nc: Connection | NatsClient,
        *,
        tenant: str = "default",
        owns_connection: bool = False,
        route_subjects: bool = False,
    ) -> None:
        self.nc = Connection.of(nc)
        self.js = self.nc.jetstream()
        self.tenant = tenant
        #: Publish each request to the subject naming its route
        #: (``rq.req.<level>.<tenant>.<route>``): for a deployment whose binding
        #: is split in groups (docs/scaling.md), where a request without its
        #: route is forwarded to it first (one more stored message). The
        #: tenant's permissions must allow it (nats/auth.conf).
        self.route_subjects = route_subjects
        self._owns = owns_connection
        #: Follows the tenant's events from the first submit; resolves handles.
        self._tap = EventTap(self)
        self._closed = False

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        tenant: str = "default",
        name: str = "client",
        inbox_prefix: str | None = None,
        user_credentials: str | None = None,
        route_subjects: bool = False,
    ) -> Self:
        """Connect to ``url`` (``nats://user:password@host:port`` for a password user).

        ``inbox_prefix`` is the inbox the user may subscribe to (``_INBOX_acme``
        in ``nats/auth.conf``); ``user_credentials`` a NATS ``.creds`` file;
        ``route_subjects``: see :attr:`route_subjects`.
        """
        config = NatsConfig(credentials_file=user_credentials, inbox_prefix=inbox_prefix)
        return cls(
            await connect(url, name=name, config=config),
            tenant=tenant,
            owns_connection=True,
            route_subjects=route_subjects,
        )

    async def close(self) -> None:
        """Stop following events; close the connection if this client opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._tap.close()
        if self._owns:
            await self.nc.drain()

    def build_request(
        self,
        prompt: str | Iterable[ChatMessage | Mapping[str, Any]],
        *,
        route: str,
        priority: str = "normal",
        request_id: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        params: GenerationParams | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        max_cost: float | None = None,
        complexity: int | None = None,
        metadata: Mapping[str, str] | None = None,
        parent_id: str | None = None,
        dedupe_key: str | None = None,
        coalesce: bool = False,
        stream: bool = True,
    ) -> InferenceRequest:
        """Build and validate a request, without sending it (see :meth:`submit_request`).

        The parameters are those of :meth:`submit`. Raises
        :class:`MalformedRequestError` naming the bad field.
        """
        if isinstance(prompt, str):
            messages: list[Any] = [{"role": "user", "content": prompt}]
        else:
            messages = [
                msgspec.to_builtins(m) if isinstance(m, ChatMessage) else dict(m) for m in prompt
            ]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        now = time.time()
        raw = {
            # 128 random bits as 32 hex digits, the shape uuid4().hex had,
            # without building a UUID (a tenth of the CPU).
            "id": request_id or secrets.token_hex(16),
            "tenant": self.tenant,
            "route": route,
            "messages": messages,
            "params": msgspec.to_builtins(
                _params(
                    params,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    stop=stop,
                    seed=seed,
                )
            ),
            "priority": priority,
            "deadline": deadline if timeout is None else now + timeout,
            "max_cost": max_cost,
            "complexity": complexity,
            "metadata": dict(metadata or {}),
            "submitted_at": now,
            "parent_id": parent_id,
            "dedupe_key": dedupe_key,
            "coalesce": coalesce,
            "stream": stream,
        }
        try:
            # Decoding validates every constraint (constructors do not).
            return REQUEST_DECODER.decode(msgspec.json.encode(raw))
        except msgspec.ValidationError as exc:
            raise MalformedRequestError(str(exc), request_id=str(raw["id"])) from exc

    async def submit(
        self,
        prompt: str | Iterable[ChatMessage | Mapping[str, Any]],
        *,
        route: str,
        priority: str = "normal",
        request_id: str | None = None,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        params: GenerationParams | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - sets the request's deadline
        deadline: float | None = None,
        max_cost: float | None = None,
        complexity: int | None = None,
        metadata: Mapping[str, str] | None = None,
        parent_id: str | None = None,
        dedupe_key: str | None = None,
        coalesce: bool = False,
        stream: bool = True,
        traceparent: str | None = None,
    ) -> RequestHandle:
        """Submit a request; the handle streams its tokens and waits for its result.

        Idempotent on ``request_id``: submitting the same id again returns a
        handle on the original (``handle.duplicate``), within the stream's
        duplicate window. A publish the broker does not answer is sent again
        (:meth:`submit_request`).

        Args:
            prompt: The user's message, or the whole conversation as
                :class:`ChatMessage` objects (content parts, tool calls and
                tool results included) or mappings of their fields.
            route: The model group to run on (a ``[routes.<name>]`` of the config).
            priority: A level name from the config (``critical``, ``high``,
                ``normal``, ``low``, ``batch`` by default).
            request_id: The id (letters, digits, ``_``, ``-``; up to 128); a
                random one when ``None``. Scoped by tenant.
            system: A system message put before the prompt.
            max_tokens: Upper bound on generated tokens (backend default if ``None``).
            temperature: Sampling temperature (backend default if ``None``).
            top_p: Nucleus sampling (backend default if ``None``).
            stop: Stop sequences (backend default if ``None``).
            seed: Sampling seed, for backends that take one.
            params: Every generation parameter the wire carries (tools,
                ``tool_choice``, ``response_format``, penalties, logprobs,
                ``user``, pass-through ``extra``, ...); the five above, given
                too, replace its own.
            timeout: Seconds from now until the deadline; overrides ``deadline``.
            deadline: The deadline as a Unix time in seconds. A request not
                finished by then ends expired. ``None``: no deadline.
            max_cost: A spend ceiling in US dollars: never bound to a backend
                whose estimated cost (prompt and ``max_tokens``, or 1024 output
                tokens, at its prices) is above it; rejected
                (``over_cost_cap``) when no backend of the route can meet it.
            complexity: The lowest backend tier that can do the job (0-100).
            metadata: Up to 64 string pairs carried along, for your own use.
            parent_id: A request this one is part of: it never runs at a lower
                effective priority than that parent (same tenant).
            dedupe_key: Requests of this tenant with the same key share one
                backend call.
            coalesce: Share a call with identical requests (same route,
                messages and parameters).
            stream: ``False`` when only :meth:`RequestHandle.result` will be
                wanted: no token chunk is stored for the request (fewer
                writes; the result is the same, whole), and
                :meth:`RequestHandle.stream` raises
                :class:`TokensNotStreamedError`.
            traceparent: A W3C ``traceparent`` (``00-<trace id>-<parent
                id>-<flags>``) to carry the request in: its trace id goes
                on, under a span of the submit's own. ``None``, or one that
                is not valid (dropped, never an error): a new trace. The
                handle's ``traceparent`` is what was sent.

        Raises:
            MalformedRequestError: A parameter fails validation (the field is named).
            UnknownPriorityError: No stream takes ``priority``.
            NatsPayloadTooLargeError: The request is over what the broker takes.
            NatsUnavailableError: The broker did not answer for
                :attr:`submit_patience` (or until the deadline): the last try's error, often a
                :class:`NatsTimeoutError`. The request may have been stored
                all the same; submit it again with the same id to find out.
        """
        return await self.submit_request(self.build_request(
            prompt, route=route, priority=priority, request_id=request_id, system=system,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
            params=params, timeout=timeout, deadline=deadline, max_cost=max_cost,
            complexity=complexity, metadata=metadata, parent_id=parent_id, dedupe_key=dedupe_key,
            coalesce=coalesce, stream=stream), traceparent=traceparent)  # fmt: skip

    async def submit_request(
        self, request: InferenceRequest, *, traceparent: str | None = None
    ) -> RequestHandle:
        """Submit a built request. Idempotent on ``request.id``; raises as
        :meth:`submit` says (``traceparent`` too).

        A publish the broker does not answer (a restart, a lost connection)
        is sent again under the same id, with a capped backoff, for
        :attr:`submit_patience` seconds or until the deadline if sooner: the
        duplicate window (far longer) makes that safe, and a retry that finds
        its first try stored is not a duplicate (``handle.found_on_retry``
        says so).
        """
        # The submit is a hop of its own: its span, under the caller's trace.
        attributes: dict[str, str | int] = {
            "renqueue.request_id": request.id,
            "renqueue.tenant": request.tenant,
            "renqueue.route": request.route,
            "renqueue.priority": request.priority,
        }
        with hop("renqueue.submit", traceparent, kind="producer", attributes=attributes) as trace:
            return await self._submit_in(request, trace)

    async def _submit_in(self, request: InferenceRequest, trace: TraceParent) -> RequestHandle:
        """:meth:`submit_request`, in its hop's ``trace``."""
        if request.tenant != self.tenant:
            # Not on this client's tap: the handle reads the request's own events.
            return self._handle_on(request, await self._publish(request, trace), trace)
        await self._tap.ensure()
        # A handle or a submit of this client may already wait for this id (a
        # resubmit): they share one waiter, held until none of them needs it.
        waiter = self._tap.hold(request.id)
        try:
            published = await self._publish(request, trace)
        except BaseException:
            self._tap.release(request.id, waiter)
            raise
        if published is Published.STORED:
            waiter.stored = True
        elif not waiter.stored:
            # Stored before this client followed events (by another client,
            # or a publish whose ack was lost), or found by a retry (by this
            # submit's lost try, after the tap followed, or by a resubmit at
            # the same moment, maybe before): it may have ended already,
            # unseen by the tap. The handle reads the request's own events.
            self._tap.release(request.id, waiter)
            return self._handle_on(request, published, trace)
        return self._handle_on(request, published, trace, waiter=waiter)

    async def _publish(self, request: InferenceRequest, trace: TraceParent) -> Published:
        """The one publish of a submit: stored now, stored before (a resubmit),
        or found stored by a retry (:func:`._retries.publish`)."""
        return await publish(self, request, trace=trace)

    def _handle_on(
        self,
        request: InferenceRequest,
        published: Published,
        trace: TraceParent,
        *,
        waiter: Waiter | None = None,
    ) -> RequestHandle:
        """The handle a submit of ``request`` returns, saying what its publish found."""
        return RequestHandle(
            self,
            request.id,
            request.tenant,
            duplicate=published is Published.DUPLICATE,
            found_on_retry=published is Published.FOUND_ON_RETRY,
            waiter=waiter,
            traceparent=trace.header,
            streamed=request.stream,
        )

    def handle(self, request_id: str) -> RequestHandle:
        """A handle for a request submitted earlier or elsewhere."""
        return RequestHandle(self, request_id, self.tenant, duplicate=True)

    async def _follow_terminal(self, request_id: str) -> Event:
        """The terminal event of this tenant's request ``request_id`` (for a
        handle not given a waiter at its submit): through the event tap."""
        return await self._tap.follow(request_id)
