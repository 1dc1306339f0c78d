"""``schema``, ``mock-backend`` and ``demo``: tools around Ren-Queue."""

from __future__ import annotations

import asyncio
import errno
import json
from pathlib import Path
from typing import Any

import click
import msgspec

from ..errors import ConfigError, RenQueueError
from ._app import cli, command, setup


@command(
    cli,
    "schema",
    short_help="Print the JSON Schema of every wire message and event.",
    epilog="Example: renqueue schema > renqueue-schema.json",
)
@click.pass_context
def schema(ctx: click.Context) -> None:
    """The JSON Schema of the request, dispatch, token chunk and every event,
    as one document of $defs: what another language needs to speak to it."""
    from ..schema import Dispatch, Event, InferenceRequest, TokenChunk

    setup(ctx)
    types: list[Any] = [InferenceRequest, Dispatch, TokenChunk, Event]
    (_schemas, components) = msgspec.json.schema_components(types)
    click.echo(json.dumps({"$defs": components}, indent=2, sort_keys=True))


@command(
    cli,
    "mock-backend",
    short_help="Serve a mock LLM (OpenAI, Anthropic, Ollama, TGI and Gemini APIs).",
    epilog="Example: renqueue mock-backend --port 8000 --tps 50 --fault 503=0.1",
)
@click.option("--host", default="127.0.0.1", help="Listen on this address.")
@click.option("--port", type=click.IntRange(0, 65535), default=8100, help="Listen on this port.")
@click.option("--ttft", type=float, default=0.05, help="Seconds to the first token.")
@click.option("--tps", type=float, default=100.0, help="Tokens per second (0: instant).")
@click.option("--output-tokens", type=int, default=32, help="Answer length in tokens.")
@click.option("--failure-rate", type=float, default=0.0, help="Share of calls answered 500.")
@click.option("--rpm", type=int, default=0, help="Requests per minute it allows (0: any).")
@click.option("--tpm", type=int, default=0, help="Tokens per minute it allows (0: any).")
@click.option("--rpd", type=int, default=0, help="Requests per day it allows (0: any).")
@click.option(
    "--limit-style",
    default="openai",
    help="Rate-limit header dialect: openai, groq, cerebras, openrouter, openrouter-body, "
    "anthropic, gemini, ietf.",
)
@click.option("--concurrency", type=int, default=0, help="Concurrent requests (0: any).")
@click.option("--model", help="Accept only this model name (default: any).")
@click.option("--seed", type=int, help="Seed for reproducible failure draws (default: random).")
@click.option(
    "--fault-script",
    default="",
    metavar="KINDS",
    help="Faults for chat requests in arrival order, e.g. 500,ok,reset (ok: a normal answer); "
    "kinds: 500 503 529 reset hang drip 429 429_bare quota malformed break no_done no_finish "
    "sse_error context_length content_filter filtered.",
)
@click.option("--fault-repeat", is_flag=True, help="Repeat the fault script forever.")
@click.option(
    "--fault",
    "fault_rates",
    multiple=True,
    metavar="KIND=RATE",
    help="A random fault and its probability, e.g. 503=0.1 (repeatable; seeded by --seed).",
)
@click.option("--context-window", type=int, default=0, help="Prompt tokens it accepts (0: any).")
@click.option("--drip-gap", type=float, help="Seconds between drip tokens (default: 5).")
@click.pass_context
def mock_backend(ctx: click.Context, /, **options: Any) -> None:
    """A mock LLM server: the OpenAI API at /v1, Anthropic at /v1/messages, Ollama
    at /api/chat, TGI at /generate_stream, Gemini at
    /v1beta/models/<m>:streamGenerateContent; limits and faults as asked."""
    from ..mock import run_mock_backend

    setup(ctx, service=True)
    host, port = options["host"], options["port"]
    try:
        run_mock_backend(
            fault_rates=list(options.pop("fault_rates")),
            # One line, the URL last: scripts read it (bench/common.py).
            on_ready=lambda url: print(f"mock backend serving at {url}", flush=True),
            **options,
        )
    except ValueError as exc:
        raise ConfigError(str(exc), path="mock-backend options") from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise RenQueueError(
                f"cannot listen on {host}:{port}: the port is in use (another mock backend, "
                "or the model server itself?); pick another with --port"
            ) from None
        raise RenQueueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


@command(
    cli,
    "demo",
    short_help="Run everything embedded on a mixed workload and summarise it.",
    epilog="Examples: renqueue demo --requests 100; renqueue demo --real",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=None,
    help="Requests to submit (200; 16 with --real).",
)
@click.option(
    "--real",
    is_flag=True,
    help="A real model as the local tier: llama-cpp-python's server on SmolLM2-135M, in a"
    " venv of its own made on first use (pip builds it from source: 16 minutes or more).",
)
@click.option(
    "--venv",
    type=click.Path(path_type=Path),
    default=None,
    help="Where --real's venv is (made if missing). Default: .renqueue/real-venv",
)
@click.pass_context
def demo(ctx: click.Context, requests: int | None, real: bool, venv: Path | None) -> int:
    """NATS, four mock backends, routers and workers, all in this process; a
    mixed workload of priorities and tenants; a summary of where each went.
    With --real, the local tier is a real model server (200 requests become 16)."""
    from ..demo import run_demo, run_real_demo
    from ..llamacpp import DEFAULT_VENV

    setup(ctx, quiet=True)
    if real:
        done = asyncio.run(run_real_demo(requests=requests or 16, venv=venv or DEFAULT_VENV))
    else:
        if venv is not None:
            raise click.UsageError("--venv goes with --real")
        done = asyncio.run(run_demo(requests=requests or 200))
    return 0 if done else 1
