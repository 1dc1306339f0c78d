"""Running against NATS: the embedded server, provisioning, the connection.

- :class:`EmbeddedServer` (``_embedded``): the ``nats-server`` Ren-Queue starts
  when no URL is given.
- :func:`provision` (``_provision``): applies ``streams/`` idempotently.
- :func:`connect` (``_connection``): one NATS connection with the client
  defaults Ren-Queue needs.
"""

from ._connection import connect, redact_url, resolve_nats_url
from ._embedded import (
    LOCK_FILE_NAME,
    URL_FILE_NAME,
    EmbeddedServer,
    ServerState,
    find_nats_server,
    url_file,
)
from ._provision import (
    STREAMS_DIR_ENV,
    Action,
    ProvisionItem,
    ProvisionReport,
    find_streams_dir,
    provision,
    renew_router_consumers,
    router_consumer_configs,
    until_jetstream_answers,
)

__all__ = [
    "LOCK_FILE_NAME",
    "STREAMS_DIR_ENV",
    "URL_FILE_NAME",
    "Action",
    "EmbeddedServer",
    "ProvisionItem",
    "ProvisionReport",
    "ServerState",
    "connect",
    "find_nats_server",
    "find_streams_dir",
    "provision",
    "redact_url",
    "renew_router_consumers",
    "resolve_nats_url",
    "router_consumer_configs",
    "until_jetstream_answers",
    "url_file",
]
