"""The async client: submit requests, stream their tokens, await their results.

::

    async with await Client.connect("nats://127.0.0.1:4222", tenant="acme") as client:
        handle = await client.submit("Hello!", route="chat-small", priority="high")
        async for chunk in handle.stream():
            print(chunk.text, end="")
        result = await handle.result()

Submits are idempotent: the request id is the JetStream message id, so a
resubmit with the same id (after a timeout, say) creates nothing new and the
returned handle follows the original request. A submit whose publish gets no
answer (the broker restarting, a connection lost) publishes again itself,
under the same id, for :attr:`Client.submit_patience` (30 s) or until the
request's deadline if sooner; only then does the caller get the error.

Results come from the event log. One consumer per client (the *tap*) follows
the tenant's events from the moment of the first submit and resolves waiting
handles; a handle for a request submitted elsewhere or earlier reads that
request's own events instead. Token streams are followed live on the token
subject, with stored chunks read back from ``RQ_TOKENS``, so a subscriber that
starts late or reconnects still gets every chunk, in order, once.

Every message is taken on its subject's word, never its payload's. A tenant
can make the server deliver its own stored messages to any subject (a push
consumer's ``deliver_subject`` is unchecked), so a live token is accepted only
if it arrived on exactly ``rq.tok.<tenant>.<request_id>``, and an event only
if its own consumer delivered it and its subject
``rq.evt.<tenant>.<request_id>.<kind>`` agrees with its payload. Tenants may
write only ``cancel_requested`` events, so a result always comes from an
event the services wrote. Anything else is dropped and counted
(``renqueue_misdirected_messages_total``).

Everything a client does works under a tenant's NATS permissions
(``nats/auth.conf``): every API subject it uses names the tenant's own
subjects. Under per-user permissions, connect with the user's inbox prefix::

    await Client.connect("nats://acme:PASSWORD@host:4222", tenant="acme",
                         inbox_prefix="_INBOX_acme")

The parts: :class:`Client` (``_client``) builds, validates and submits;
:class:`RequestHandle` and :class:`Result` (``_handle``) are what a caller
holds; the event tap (``_tap``) resolves handles; the token follower
(``_tokens``) streams a request's chunks; ``_retries`` rides out a broker
that does not answer (reads retried, publishes sent again under the same id).
"""

from ._client import Client
from ._handle import RequestHandle, Result

__all__ = ["Client", "RequestHandle", "Result"]
