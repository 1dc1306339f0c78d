"""``gateway``: the OpenAI-compatible HTTP gateway, and ``gateway keygen``."""

from __future__ import annotations

import asyncio

import click
import msgspec

from ._app import CONTEXT, cli, command, global_options, setup
from ._common import TenantName, client_url


@cli.group(
    "gateway",
    context_settings=CONTEXT,
    invoke_without_command=True,
    short_help="Serve the OpenAI-compatible HTTP gateway only (scale out); keygen makes keys.",
    epilog="Example: renqueue gateway --nats nats://127.0.0.1:4222 --port 8080",
)
@global_options
@click.option("--host", help="Listen on this address (default: [gateway] host).")
@click.option(
    "--port", type=click.IntRange(0, 65535), help="Listen on this port (default: [gateway] port)."
)
@click.pass_context
def gateway(ctx: click.Context, host: str | None, port: int | None) -> None:
    """Serve the OpenAI-compatible gateway (POST /v1/chat/completions, ...; see
    docs/gateway.md) on [gateway] host:port, joining a running Ren-Queue (--nats
    or RENQUEUE_NATS_URL). `renqueue gateway keygen TENANT` makes an API key."""
    if ctx.invoked_subcommand is not None:
        return
    from ..gateway import run_gateway

    config = setup(ctx, service=True)
    if port is not None or host is not None:
        settings = msgspec.structs.replace(
            config.gateway,
            port=config.gateway.port if port is None else port,
            host=config.gateway.host if host is None else host,
        )
        config = msgspec.structs.replace(config, gateway=settings)
    asyncio.run(run_gateway(config, client_url(config)))


@command(
    gateway,
    "keygen",
    short_help="Make an API key for a tenant (or --admin: for the console).",
    epilog="Example: renqueue gateway keygen acme",
)
@click.argument("tenant", type=TenantName(), required=False)
@click.option("--admin", is_flag=True, help="An admin key, for the web console (/console).")
@click.pass_context
def keygen(ctx: click.Context, tenant: str | None, admin: bool) -> None:
    """Make an API key for TENANT (or, with --admin, for the web console), and
    print it once with the config entry that accepts it (its digest only)."""
    from ..gateway import digest, new_key

    setup(ctx)
    if admin == (tenant is not None):
        raise click.UsageError("give a TENANT, or --admin for the console's admin key (not both)")
    key = new_key()
    if admin:
        click.echo("Admin key for the console (shown once; it opens /console, for no tenant):")
        click.echo(f"  {key}")
        click.echo("Add its digest to the gateway's config (it stores the digest, never the key):")
        click.echo(f'  [gateway]\n  admin_keys = ["{digest(key)}"]')
        return
    click.echo(f"API key for tenant {tenant} (shown once; give it to the client):")
    click.echo(f"  {key}")
    click.echo("Add one of these to the gateway's config (it stores the digest, never the key):")
    click.echo(f'  [[gateway.keys]]\n  tenant = "{tenant}"\n  sha256 = "{digest(key)}"')
    click.echo(f"  or a line of [gateway] keys_file:  sha256:{digest(key)} {tenant}")
