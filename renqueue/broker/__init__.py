"""The broker: everything that talks to NATS itself. I/O.

- The NATS boundary (``_nats``): typed handles on a connection —
  :class:`Connection`, :class:`JetStream`, :class:`KeyValue`, :class:`Message`,
  subscriptions — and the one place a nats-py error becomes a
  :class:`renqueue.errors.NatsError`. Nothing else imports ``nats``.
- :func:`connect` and :class:`ConnectionKeeper` (``_connection``): one NATS
  connection with the client defaults Ren-Queue needs, and a service's
  connection renewed when the server closes it.
- :class:`EmbeddedServer` (``_embedded``): the ``nats-server`` Ren-Queue starts
  when no URL is given.
- :func:`provision` (``_provision``): applies ``streams/`` idempotently.
- The event log (``_eventlog``): :class:`EventLog` writes and reads ``RQ_EVENTS``;
  a terminal event goes through the request's terminal claim, so each request
  records exactly one.
- Dead letters (``_dlq``): :class:`DeadLetters`, listing, showing and requeueing
  ``RQ_DLQ``.
- Trace context (``_trace``): the ``traceparent`` header of a message
  (:func:`trace_of`) and each hop's span under it (:func:`next_hop`,
  :func:`hop`), exported through OpenTelemetry once :func:`export_spans` is
  called (``_otel``, the ``otel`` extra).
"""

from ._connection import ConnectionKeeper, connect, redact_url, resolve_nats_url
from ._dlq import (
    DeadLetterError,
    DeadLetterFilter,
    DeadLetters,
    entry_fields,
    entry_json,
    render_entry,
    render_listing,
)
from ._embedded import (
    LOCK_FILE_NAME,
    URL_FILE_NAME,
    EmbeddedServer,
    ServerState,
    find_nats_server,
    url_file,
)
from ._eventlog import (
    DLQ_HOSTILE_EXCERPT,
    EventLog,
    StoredClaim,
    delete_consumer,
    msg_id_of,
    publish_stored,
    read_messages,
    read_subject,
    subject_agrees,
    submitted_of,
    surely_stored,
)
from ._nats import (
    NOT_NOW,
    WRONG_LAST_SEQUENCE,
    AckPolicy,
    Connection,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    JetStream,
    JetStreamApi,
    KeyEntry,
    KeyValue,
    KeyWatcher,
    Message,
    MessageMetadata,
    NatsClient,
    PubAck,
    PullSubscription,
    StoredMessage,
    StreamInfo,
    Subscription,
    reply_error,
    translate,
)
from ._provision import (
    STORES,
    STREAMS_DIR_ENV,
    Action,
    ProvisionItem,
    ProvisionReport,
    ensure_router_consumers,
    find_streams_dir,
    provision,
    renew_router_consumers,
    router_consumer_configs,
    until_jetstream_answers,
)
from ._trace import SpanKind, export_spans, hop, next_hop, trace_headers, trace_of

__all__ = [
    "DLQ_HOSTILE_EXCERPT",
    "LOCK_FILE_NAME",
    "NOT_NOW",
    "STORES",
    "STREAMS_DIR_ENV",
    "URL_FILE_NAME",
    "WRONG_LAST_SEQUENCE",
    "AckPolicy",
    "Action",
    "Connection",
    "ConnectionKeeper",
    "ConsumerConfig",
    "ConsumerInfo",
    "DeadLetterError",
    "DeadLetterFilter",
    "DeadLetters",
    "DeliverPolicy",
    "EmbeddedServer",
    "EventLog",
    "JetStream",
    "JetStreamApi",
    "KeyEntry",
    "KeyValue",
    "KeyWatcher",
    "Message",
    "MessageMetadata",
    "NatsClient",
    "ProvisionItem",
    "ProvisionReport",
    "PubAck",
    "PullSubscription",
    "ServerState",
    "SpanKind",
    "StoredClaim",
    "StoredMessage",
    "StreamInfo",
    "Subscription",
    "connect",
    "delete_consumer",
    "ensure_router_consumers",
    "entry_fields",
    "entry_json",
    "export_spans",
    "find_nats_server",
    "find_streams_dir",
    "hop",
    "msg_id_of",
    "next_hop",
    "provision",
    "publish_stored",
    "read_messages",
    "read_subject",
    "redact_url",
    "render_entry",
    "render_listing",
    "renew_router_consumers",
    "reply_error",
    "resolve_nats_url",
    "router_consumer_configs",
    "subject_agrees",
    "submitted_of",
    "surely_stored",
    "trace_headers",
    "trace_of",
    "translate",
    "until_jetstream_answers",
    "url_file",
]
