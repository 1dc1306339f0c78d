"""A delivery's lease: renewed while its run lives, never after it ended.

The worker renews a dispatch message's lease (``in_progress``) every third of
the consumer's ``ack_wait`` for as long as its run is alive
(:meth:`Delivery.keep_alive`), and stops when the run ends
(:meth:`Delivery.stop_renewing`): the message then comes back once the lease
runs out, as it would after a worker died.
"""

from __future__ import annotations

import asyncio

from renqueue import Client, parse_config
from renqueue.broker import Connection, EmbeddedServer, provision
from renqueue.schema import DISPATCH_STREAM, Dispatch, dispatch_subject, encode, worker_consumer
from renqueue.services.worker._delivery import Delivery

TENANT = "t"


async def test_a_lease_is_renewed_while_its_run_lives_and_runs_out_after(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    config = parse_config(
        {
            "nats": {"url": isolated_server.url},
            "backends": {"b": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"ack_wait": "1s"},
        }
    )
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    psub = await js.pull_subscribe_bind(durable=worker_consumer("b"), stream=DISPATCH_STREAM)
    request = Client(isolated_nc, tenant=TENANT).build_request("a long run", route="chat")
    await js.publish(dispatch_subject("b"), encode(Dispatch(request=request, backend="b")))
    [msg] = await psub.fetch(batch=1, timeout=5)
    delivery = Delivery(msg, ack_wait=1.0)
    renewed = asyncio.Queue[None]()
    still_working = delivery.still_working

    async def counted() -> None:
        await still_working()
        renewed.put_nowait(None)

    delivery.still_working = counted  # type: ignore[method-assign]
    delivery.keep_alive()
    try:
        # Renewed three times: the run has lived past its 1 s lease.
        for _ in range(3):
            await asyncio.wait_for(renewed.get(), 5)
        info = await js.consumer_info(DISPATCH_STREAM, worker_consumer("b"))
        assert info.num_redelivered == 0
        assert info.num_ack_pending == 1
    finally:
        delivery.stop_renewing()
    renewals = renewed.qsize()
    # Not renewed any more: the broker delivers it again once the lease runs out.
    [again] = await psub.fetch(batch=1, timeout=10)
    assert again.metadata.num_delivered == 2
    assert renewed.qsize() == renewals
    await again.ack()


async def test_a_delivery_handed_back_is_not_renewed_while_its_run_ends(
    isolated_server: EmbeddedServer, isolated_nc: Connection
) -> None:
    """A hand-back (``nak`` with a delay) is the message's last answer: a
    renewal after it (its run still finishing, say on a connection slow to
    flush) would reset the broker's timer to a whole ``ack_wait`` from then,
    again and again, and the message would not come back after its delay."""
    config = parse_config(
        {
            "nats": {"url": isolated_server.url},
            "backends": {"b": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
            "routes": {"chat": {"backends": ["b"]}},
            "worker": {"ack_wait": "1s"},
        }
    )
    await provision(isolated_nc, config)
    js = isolated_nc.jetstream()
    psub = await js.pull_subscribe_bind(durable=worker_consumer("b"), stream=DISPATCH_STREAM)
    request = Client(isolated_nc, tenant=TENANT).build_request("handed back", route="chat")
    await js.publish(dispatch_subject("b"), encode(Dispatch(request=request, backend="b")))
    [msg] = await psub.fetch(batch=1, timeout=5)
    delivery = Delivery(msg, ack_wait=1.0)
    delivery.keep_alive()
    try:
        # Longer than a renewal's period (1/3 s): a renewal falls due before it is over.
        await delivery.hand_back(after=0.6)
        # The run has not ended yet (stop_renewing not called): the message
        # comes back after its delay all the same.
        [again] = await psub.fetch(batch=1, timeout=8)
    finally:
        delivery.stop_renewing()
    assert again.metadata.num_delivered == 2
    await again.ack()
