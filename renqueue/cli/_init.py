"""``init``: a starter ``renqueue.toml``."""

from __future__ import annotations

from pathlib import Path

import click

from ..config import load_config
from ._app import cli, command, setup

#: The starter config: two local backends (run on mocks by ``up --mocks``), a
#: free tier and a paid one (left out, with a warning, until their key is set).
STARTER = """\
# Ren-Queue configuration, written by `renqueue init`. Every key is optional
# unless marked; a bad value fails at start-up with the path of the field.
# All keys: docs/configuration.md. API keys never go here: name the
# environment variable holding them (api_key_env).
#
# Try it with no model server: `renqueue up --mocks` serves a mock LLM on each
# local port below; then `renqueue submit "hello" --wait 30`, `renqueue status`.

# Priority levels, most urgent first. Requests name one of these.
priorities = ["critical", "high", "normal", "low", "batch"]
default_priority = "normal"

[nats]
url = ""                      # empty: `renqueue up` starts an embedded nats-server
data_dir = ".renqueue"        # its JetStream store
port = 4222

# ---------------------------------------------------------------- backends
# tier: capability class (a request's `complexity` needs tier >= it).
# cost_*_per_mtok: US dollars per million input/output tokens (local: free).
# limits: concurrency (slots), and requests/tokens as COUNT/WINDOW.

# Local: an OpenAI-compatible server (vLLM, llama.cpp, LM Studio) on this machine.
[backends.local-small]
base_url = "http://127.0.0.1:8000/v1"
model = "meta-llama/Llama-3.1-8B-Instruct"
tier = 1
tags = ["local"]
limits = { concurrency = 8 }

# Local: Ollama, its native API.
[backends.local-large]
adapter = "ollama"
base_url = "http://127.0.0.1:11434"
model = "qwen2.5:32b"
tier = 3
tags = ["local"]
limits = { concurrency = 2 }

# Free tier: Groq. Left out (with a warning) while GROQ_API_KEY is unset.
[backends.groq-free]
base_url = "https://api.groq.com/openai/v1"
model = "llama-3.1-8b-instant"
api_key_env = "GROQ_API_KEY"
tier = 1
tags = ["free"]
limits = { concurrency = 4, requests = ["30/min", "14400/day"], tokens = ["6000/min"] }

# Paid: OpenAI, the last resort. Left out while OPENAI_API_KEY is unset.
[backends.openai-paid]
base_url = "https://api.openai.com/v1"
model = "gpt-4o-mini"
api_key_env = "OPENAI_API_KEY"
tier = 3
cost_input_per_mtok = 0.15
cost_output_per_mtok = 0.60
tags = ["paid"]
limits = { concurrency = 32, requests = ["500/min"] }

# ------------------------------------------------------------------ routes
# A route is what clients ask for (`submit --route`; the first is the default):
# its backends in cascade order; a request goes to the cheapest that has room
# and can finish before its deadline.

[routes.chat-small]
backends = ["local-small", "groq-free", "openai-paid"]

[routes.chat-large]
backends = ["local-large", "openai-paid"]

# ------------------------------------------------------------------ tenants
# Daily budgets in US dollars per UTC day (soft: free and local backends only
# once spent; hard: refuse new requests until 00:00 UTC).
# [tenants."*"]
# daily_budget = 5.0

# ------------------------------------------------------------------ gateway
# The OpenAI-compatible HTTP API (docs/gateway.md): `renqueue up` serves it
# once it has a key; `renqueue gateway keygen TENANT` makes one.
# [gateway]
# port = 8080
# [[gateway.keys]]
# tenant = "team-a"
# sha256 = "<64 hex digits>"
"""


@command(
    cli,
    "init",
    short_help="Write a starter renqueue.toml (local, free-tier and paid backends).",
    epilog="Example: renqueue init && renqueue up --mocks",
)
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path), default="renqueue.toml")
@click.option("--force", is_flag=True, help="Overwrite the file if it exists.")
@click.pass_context
def init(ctx: click.Context, path: Path, force: bool) -> None:
    """Write a starter config to PATH: two local backends (served by mocks with
    `renqueue up --mocks`), a free tier and a paid one, every key commented."""
    setup(ctx, config=False)
    if path.exists() and not force:
        raise click.UsageError(f"{path} exists; give --force to overwrite it")
    try:
        path.write_text(STARTER)
    except OSError as exc:
        raise click.UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    load_config(str(path))  # the starter always loads; a test pins it too
    click.echo(f"wrote {path}; next: `renqueue up --mocks`, then in another terminal")
    click.echo('`renqueue submit "hello" --wait 30` and `renqueue status`')
