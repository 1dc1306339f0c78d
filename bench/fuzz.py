"""Hostile input at scale (issue #30 item 2): ``make fuzz``.

While a steady good workload runs (``renqueue.Client`` submissions from tenant ``acme``
through the real services on a real nats-server), this sends:

- **NATS** (``--nats``, 10,000): hostile messages from tenant ``globex``, connected with
  its own credentials under ``nats/auth.conf``, on every subject a tenant may publish to:
  ``rq.req.<level>.globex`` (requests), ``rq.cancel.globex.<id>`` (cancellations, which
  the log sources as ``rq.evt.globex.<id>.cancel_requested``; one over 4096 bytes is
  refused by the broker) and the JetStream API subjects of its permissions (consumer
  creates, direct gets, consumer deletes; among them consumers that deliver its own events to the
  services' core subjects, ``rq.capacity.*``, ``rq.boost.*``, ``rq.preempt.*``). Random
  (bytes, broken and huge and deep JSON, wrong types) and structure-aware (requests and
  cancellations drawn by Hypothesis, then bent: forged tenants and ids, ``Nats-Msg-Id``
  forms, absurd parameters such as a 5 MB ``stop``, ``seed`` 2^70, ``deadline`` 1e300,
  ``v`` 0 and -1), replayed and reordered (the same message again; a cancellation before
  its request; a rejected request sent again corrected, under the same id);
- **HTTP** (``--http``, 10,000): hostile requests to the gateway (``renqueue up`` serves
  it): bad JSON, huge bodies and lying ``Content-Length``, slow senders, half-closed
  connections, header floods, invalid keys, wrong paths and methods, structure-aware
  chat bodies with absurd values;
- **config** (``--configs``, 1,000): malformed config files through
  ``renqueue.config.load_config``: each must give ``ConfigError`` (or load), never
  another exception.

The services are one ``renqueue up`` process (routers, workers, projector, gateway) with
its Prometheus metrics on a port; the mock LLM is a process of its own; each hostile
sender is a child process of this script (so their CPU does not land in the good
client's latencies; on a 2-core machine they still share the cores with the services,
which is the point). First a baseline phase (the good workload alone), then the fuzz
phase (the same workload at the same rate while the senders run), in one invocation.

It prints and checks:

- **service crashes**: the ``up`` process exiting, and supervised loops that failed
  (``background loop failed`` in its log) or a ``gateway error`` (a 500): must be 0;
- **good requests lost or failed**: must be 0;
- **hostile messages without a typed rejection or a counted drop**: must be 0. The work
  queues must drain; a stored request (``rq.req``) must have exactly one terminal event
  under an id the router records it by (the body's id, the ``Nats-Msg-Id``'s, or
  ``invalid-<seq>``); and ``renqueue_rejected_total``, the requests admitted and ended
  the runs a worker dropped as already ended (``renqueue_duplicate_completions_total``)
  and the copies the router refused as already ended (``renqueue_ended_resubmits_total``)
  must add up to at least the stored requests. A stored cancellation is either a
  cancellation of what its subject names (valid: the tenant's own word) or counted by
  ``renqueue_misdirected_messages_total{receiver="cancels"}``. A publish the server
  refused (permissions, no stream, too big, a duplicate id) is a typed answer at the
  publisher. An API call must get an answer. An HTTP request must get a 4xx
  (OpenAI-shaped JSON, or aiohttp's plain-text answer to a request it cannot parse), a
  2xx (it passed as valid and was queued), or be closed by the server: a 5xx, garbage or
  no answer within 120 s counts against it (slow senders held open without an answer
  are counted apart, as ``held``: the gateway has no read timeout yet, issue #30 item 3);
- **config files** that raised anything but ``ConfigError``: must be 0;
- the good workload's **latency** p50/p95 with the fuzz against the baseline (ratio).

Run with ``make fuzz`` (7-13 minutes at 50/s each here), or ``python bench/fuzz.py --short``
(about 30 s; ``tests/test_fuzz.py`` runs it); bench/README.md has the results. JSON:
``bench/results/fuzz-latest.json`` (and a timestamped copy). Exit status 1 if a verdict
fails.

Structure-aware generation uses Hypothesis's own machinery (``@given`` run once with
``max_examples`` = the number wanted, seeded, no database), the supported
way to draw many examples outside a test (``strategy.example()`` is not meant for it);
the strategies are written here rather than derived from ``renqueue schema`` with
hypothesis-jsonschema, because a schema's strategy draws *valid* documents, and what is
wanted is mostly invalid ones, bent field by field past the schema (wrong types, values
out of range, fields only the services may set).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
from common import RESULTS, ROOT, free_port, machine_info, mock_process, percentile
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client.parser import text_string_to_metric_families

from renqueue import Client
from renqueue.broker import EmbeddedServer
from renqueue.config import DEFAULT_PRIORITIES, load_config
from renqueue.coordination import cancel_of
from renqueue.errors import ConfigError
from renqueue.gateway import digest
from renqueue.schema import (
    DISPATCH_STREAM,
    EVENT_DECODER,
    EVENTS_STREAM,
    REQUESTS_STREAM,
    TERMINAL_KINDS,
    cancel_subject,
    event_subject,
    kind_of,
)

HERE = Path(__file__).resolve()
AUTH_CONF = ROOT / "nats" / "auth.conf"
PASSWORDS = {
    "RQ_SERVICE_PASSWORD": "fuzz-service-" + uuid.uuid4().hex,
    "RQ_TENANT_ACME_PASSWORD": "fuzz-acme-" + uuid.uuid4().hex,
    "RQ_TENANT_GLOBEX_PASSWORD": "fuzz-globex-" + uuid.uuid4().hex,
    "RQ_SYS_PASSWORD": "fuzz-sys-" + uuid.uuid4().hex,
}
GOOD = "acme"
EVIL = "globex"
ROUTE = "chat"
BACKEND = "b1"
LEVELS = DEFAULT_PRIORITIES
#: How long a hostile HTTP request (not a slow sender) may wait for its answer: one that
#: passes as valid is queued like any other, behind whatever backlog there is.
ANSWER_BOUND = 120.0
#: The gateway's body limit here (its default, 4 MiB).
MAX_BODY = 4 * 1024 * 1024


@dataclass(frozen=True)
class Mode:
    name: str
    nats: int
    http: int
    configs: int
    #: Good requests per second, and how many the baseline phase sends.
    rate: float
    baseline: int
    #: Payloads of a megabyte or more among the NATS messages (each costs the broker).
    big: int
    #: Slow senders (each holds a connection a few seconds).
    slow: int
    slow_for: float
    #: Hostile senders' concurrency (NATS, HTTP).
    concurrency: int
    #: Hostile messages (and HTTP requests) per second, each sender; 0: as fast as they go.
    hostile_rate: float = 100.0


MODES = {
    "full": Mode(
        name="full",
        nats=10_000,
        http=10_000,
        configs=1_000,
        rate=8.0,
        baseline=240,
        big=40,
        slow=100,
        slow_for=4.0,
        concurrency=16,
        hostile_rate=50.0,
    ),
    "short": Mode(
        name="short",
        nats=250,
        http=250,
        configs=100,
        rate=8.0,
        baseline=24,
        big=3,
        slow=4,
        slow_for=1.5,
        concurrency=8,
        hostile_rate=60.0,
    ),
}


# ===================================================================== generation


def _valid_request(request_id: str, level: str, rng: random.Random) -> dict[str, Any]:
    return {
        "v": 2,
        "id": request_id,
        "tenant": EVIL,
        "route": ROUTE,
        "messages": [{"role": "user", "content": "fuzz " + str(rng.random())}],
        "params": {"max_tokens": 8},
        "priority": level,
        "deadline": None,
        "submitted_at": time.time(),
    }


#: A placeholder Hypothesis draws for a big string, swapped for one of that many bytes
#: (while the mode's budget of big payloads lasts) when the message is encoded.
_BIG = re.compile(rb'"\\u0000BIG:(\d+)"')


_BIG_SHOWN = re.compile(r'"\\u0000BIG:(\d+)"')


def _big(size: int) -> str:
    return f"\x00BIG:{size}"


def _expand_big(data: bytes, budget: list[int]) -> bytes:
    def swap(match: re.Match[bytes]) -> bytes:
        if budget[0] <= 0:
            return b'"big, past the budget"'
        budget[0] -= 1
        return b'"' + b"x" * int(match.group(1)) + b'"'

    return _BIG.sub(swap, data)


def _json_bytes(value: Any) -> bytes:
    # allow_nan: NaN and Infinity are not JSON, and some peers write them anyway.
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _hypothesis_draws(strategy: Any, count: int, seed: int) -> list[Any]:
    """``count`` examples of ``strategy`` through ``@given`` (see the module docstring);
    fewer if Hypothesis runs out of distinct ones (the caller cycles them)."""
    from hypothesis import HealthCheck, Phase, given, settings  # noqa: PLC0415
    from hypothesis import seed as seeded  # noqa: PLC0415

    out: list[Any] = []
    if count <= 0:
        return out

    @seeded(seed)
    @settings(
        max_examples=count,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    collect()
    return out


def _request_overrides() -> Any:
    """A Hypothesis strategy of field overrides for an otherwise valid request: each
    field valid, wrong-typed, out of range or forged (some only the services may set)."""
    from hypothesis import strategies as st  # noqa: PLC0415

    text = st.text(max_size=40)
    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
    json_any = st.recursive(
        json_leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)
        ),
        max_leaves=12,
    )
    huge_ints = st.sampled_from([2**70, -(2**70), 2**63, -(2**63) - 1, 2**64, 10**40])
    absurd_floats = st.sampled_from([1e300, -1e300, 1.7976931348623157e308, 5e-324, -1.0, 0.0])
    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries(
            {
                "type": st.just("image_url"),
                "image_url": st.fixed_dictionaries(
                    {
                        "url": st.sampled_from(
                            [
                                "http://169.254.169.254/latest/meta-data/",
                                "file:///etc/passwd",
                                "https://example.com/a.png",
                                "data:image/png;base64,AAAA",
                                "gopher://x",
                                "",
                            ]
                        )
                    }
                ),
            }
        ),
        json_any,
    )
    message = st.fixed_dictionaries(
        {
            "role": st.one_of(
                st.sampled_from(["user", "system", "assistant", "tool", "", "root"]), json_leaf
            ),
            "content": st.one_of(text, st.lists(part, max_size=3), json_leaf),
        },
        optional={
            "name": st.one_of(text, st.integers()),
            "tool_call_id": st.one_of(text, st.integers()),
            "tool_calls": st.lists(json_any, max_size=2),
        },
    )
    params = st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(-10, 10), huge_ints, st.floats(), text),
            "temperature": st.one_of(st.floats(), absurd_floats, text),
            "top_p": st.one_of(st.floats(), absurd_floats),
            "seed": st.one_of(st.integers(), huge_ints, st.floats(), text),
            "stop": st.one_of(
                st.lists(text, max_size=8),
                st.just([_big(5_000_000)]),
                st.lists(st.just("x" * 5000), min_size=100, max_size=100),
                text,
                st.integers(),
            ),
            "presence_penalty": st.one_of(st.floats(), absurd_floats),
            "logprobs": st.one_of(st.booleans(), st.integers()),
            "top_logprobs": st.one_of(st.integers(), huge_ints),
            "response_format": st.one_of(
                json_any, st.fixed_dictionaries({"type": st.sampled_from(["json_object", "x"])})
            ),
            "tools": st.lists(json_any, max_size=3),
            "extra": st.one_of(
                st.dictionaries(text, json_any, max_size=4),
                st.just({"n": 1000}),
                st.just({"model": "gpt-4"}),
                st.just({"deep": "\x00DEEP"}),
            ),
            "unknown_param": json_any,
        },
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "v": st.one_of(
                st.sampled_from([0, -1, 1, 3, 2**31]), huge_ints, st.just("2"), st.none()
            ),
            "id": st.one_of(
                text,
                st.integers(),
                st.just(""),
                st.just("a" * 129),
                st.just("a.b"),
                st.just("*"),
                st.just(">"),
                st.none(),
            ),
            "tenant": st.one_of(
                st.sampled_from([GOOD, "_system", "", "GLOBEX", "globex ", "*", ">", "g" * 65]),
                text,
                st.integers(),
            ),
            "route": st.one_of(st.sampled_from(["nope", "", "chat.x", "*", "chat "]), json_leaf),
            "messages": st.one_of(
                st.lists(message, max_size=4), json_leaf, st.just([]), st.just("many")
            ),
            "params": st.one_of(params, json_leaf),
            "priority": st.one_of(st.sampled_from([*LEVELS, "urgent", ""]), json_leaf),
            "deadline": st.one_of(absurd_floats, st.floats(), huge_ints, text, st.none()),
            "max_cost": st.one_of(absurd_floats, st.floats(), huge_ints, text),
            "complexity": st.one_of(st.integers(), huge_ints, st.floats(), text),
            "metadata": st.one_of(
                st.dictionaries(text, st.one_of(text, st.integers()), max_size=6),
                st.just({f"k{i}": "v" for i in range(65)}),
                st.just({"k": _big(1_500_000)}),
                json_leaf,
            ),
            "requeues": st.one_of(st.integers(1, 2**40), st.integers(), text),
            "fallback": st.one_of(st.just({}), json_any),
            "split": st.one_of(st.just(ROUTE), text),
            "parent_id": st.one_of(text, st.integers()),
            "dedupe_key": st.one_of(text, st.integers()),
            "coalesce": st.one_of(st.booleans(), text, st.integers()),
            "submitted_at": st.one_of(absurd_floats, st.floats(), text),
            "no_such_field": json_any,
        },
    )


def _cancel_overrides() -> Any:
    """Field overrides for an otherwise valid ``cancel_requested`` event."""
    from hypothesis import strategies as st  # noqa: PLC0415

    text = st.text(max_size=40)
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
    return st.fixed_dictionaries(
        {},
        optional={
            "v": st.one_of(st.sampled_from([0, -1, 1, 3]), leaf),
            "kind": st.one_of(
                st.sampled_from(["completed", "failed", "rejected", "submitted", "", "cancelled"]),
                leaf,
            ),
            "tenant": st.one_of(st.sampled_from([GOOD, "_system", ""]), leaf),
            "request_id": st.one_of(st.sampled_from(["other", "", "a" * 200]), leaf),
            "at": st.one_of(st.sampled_from([1e300, -1.0, 0.0]), leaf),
            "reason": st.one_of(text, st.just(_big(1_000_000)), leaf),
            "text": text,
            "cost": st.floats(),
        },
    )


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@dataclass
class Part:
    """One hostile NATS message (or API call)."""

    category: str
    kind: str  # "request", "cancel", "api"
    subject: str
    payload: bytes
    headers: dict[str, str] | None = None
    #: Ids the router may record a stored request under (the body's, the header's);
    #: ``invalid-<seq>`` is added once the stream sequence is known.
    ids: list[str] = field(default_factory=list)
    #: For an API call: expect an answer (a reply) from the server.
    api: bool = False
    #: Seconds to wait for the publish ack (a refused publish has none).
    timeout: float = 20.0
    #: Which bend of its category (the forged field, the absurd value, the header form).
    variant: str = ""


def _ids_of(payload: bytes, header: str | None) -> list[str]:
    ids: list[str] = []
    with contextlib.suppress(ValueError, RecursionError):
        body = json.loads(payload)
        if isinstance(body, dict) and isinstance(body.get("id"), str):
            ids.append(body["id"])
    if header:
        scope, _, rest = header.partition(":")
        if scope == EVIL:
            ids.append(rest.partition(":")[0])
    return ids


def _request_part(
    category: str,
    body: bytes,
    level: str,
    header: str | None,
    *,
    subject: str | None = None,
    variant: str = "",
) -> Part:
    return Part(
        variant=variant[:140],
        category=category,
        kind="request",
        subject=subject or f"rq.req.{level}.{EVIL}",
        payload=body,
        headers={"Nats-Msg-Id": header} if header is not None else None,
        ids=_ids_of(body, header),
    )


def nats_plan(count: int, seed: int, mode: Mode) -> list[list[Part]]:
    """The hostile NATS messages: a list of chains (each chain's parts are sent in
    order, by one sender; chains run concurrently)."""
    rng = random.Random(seed)
    budget = [mode.big]
    structured = _hypothesis_draws(_request_overrides(), count // 3, seed)
    cancels = _hypothesis_draws(_cancel_overrides(), count // 10, seed + 1)
    chains: list[list[Part]] = []
    n = 0

    def new_id() -> str:
        nonlocal n
        n += 1
        return f"fz{n}-{rng.getrandbits(32):08x}"

    def level() -> str:
        return rng.choice(LEVELS)

    def header_for(request_id: str) -> str:
        return f"{EVIL}:{request_id}"

    weights = {
        "structured": 33,
        "random_bytes": 6,
        "not_json": 6,
        "wrong_top_type": 4,
        "deep_json": 3,
        "bad_header": 8,
        "forged": 6,
        "absurd": 8,
        "replay": 4,
        "reorder": 3,
        "cancel_structured": 10,
        "cancel_random": 3,
        "api": 4,
        "refused_subject": 1,
        "huge": 1,
    }
    names = list(weights)
    picks = rng.choices(names, weights=[weights[k] for k in names], k=count)
    s_iter = iter(structured)
    c_iter = iter(cancels)
    sent = 0
    for pick in picks:
        if sent >= count:
            break
        rid = new_id()
        lvl = level()
        base = _valid_request(rid, lvl, rng)
        chain: list[Part] = []
        if pick == "structured":
            over = next(s_iter, None)
            if over is None:
                s_iter = iter(structured)
                over = next(s_iter, {}) if structured else {}
            body = {**base, **over}
            data = _json_bytes(body)
            data = _expand_big(data, budget)
            if b'"\\u0000DEEP"' in data:
                data = data.replace(b'"\\u0000DEEP"', _deep(rng.choice([100, 5000, 100_000])))
            chain.append(_request_part("structured", data, lvl, header_for(rid)))
        elif pick == "random_bytes":
            data = rng.randbytes(rng.choice([0, 1, 16, 300, 5000]))
            chain.append(_request_part("random_bytes", data, lvl, header_for(rid)))
        elif pick == "not_json":
            good = _json_bytes(base)
            data = rng.choice(
                [
                    good[: rng.randrange(1, len(good))],
                    good.replace(b'"', b"'"),
                    good + b"garbage",
                    b"\xff\xfe" + good,
                    good.replace(b"{", b"{{", 1),
                    '{"id": "\udc80"}'.encode("utf-8", "surrogatepass"),
                ]
            )
            chain.append(_request_part("not_json", data, lvl, header_for(rid)))
        elif pick == "wrong_top_type":
            data = rng.choice([b"[]", b"null", b"1e999", b'"a string"', b"true", b"[{}]", b"{}"])
            chain.append(_request_part("wrong_top_type", data, lvl, header_for(rid)))
        elif pick == "deep_json":
            depth = rng.choice([65, 200, 10_000, 200_000])
            where = rng.choice(["messages", "params", "metadata", "top"])
            if where == "top":
                data = _deep(depth)
            else:
                data = _json_bytes({**base, where: "\x00DEEP"}).replace(
                    b'"\\u0000DEEP"', _deep(depth)
                )
            chain.append(_request_part("deep_json", data, lvl, header_for(rid)))
        elif pick == "bad_header":
            form = rng.choice(
                [
                    None,
                    "",
                    rid,  # old style, without the tenant
                    f"{EVIL}:",
                    f"{GOOD}:{rid}",
                    f"{EVIL}:{rid}:requeue:x",
                    f"{EVIL}:{rid}:" + "x" * 4000,
                    f"{EVIL}:{new_id()}",  # another id than the body's
                    f"{EVIL}:{rid}\u00e9",
                    f"{EVIL}:a.b",
                    f"{EVIL}:*",
                ]
            )
            shown = "none" if form is None else form.replace(rid, "<id>")
            chain.append(_request_part("bad_header", _json_bytes(base), lvl, form, variant=shown))
        elif pick == "forged":
            forged = rng.choice(
                [
                    {"tenant": GOOD},
                    {"tenant": "_system"},
                    {"priority": "critical" if lvl != "critical" else "batch"},
                    {"requeues": 1},
                    {"fallback": {}},
                    {"split": ROUTE},
                    {"id": "a" * 129},
                    {"id": "x.y"},
                    {"parent_id": "someone-else"},
                    {"route": "nope"},
                    {"complexity": 99},
                    {"max_cost": 1e-12},
                    {"params": {"logprobs": True, "top_logprobs": 5}},
                    {"params": {"response_format": {"type": "json_schema"}}},
                ]
            )
            body = {**base, **forged}
            header = header_for(body["id"] if isinstance(body["id"], str) else rid)
            chain.append(
                _request_part("forged", _json_bytes(body), lvl, header, variant=str(forged))
            )
        elif pick == "absurd":
            absurd = rng.choice(
                [
                    {"params": {"max_tokens": 8, "stop": [_big(5_000_000)]}},
                    {"params": {"max_tokens": 8, "seed": 2**70}},
                    {"deadline": 1e300},
                    {"deadline": -1.0},
                    {"v": 0},
                    {"v": -1},
                    {"v": 3},
                    {"params": {"max_tokens": -1}},
                    {"params": {"max_tokens": 2**63}},
                    {"params": {"temperature": 1e308}},
                    {"messages": []},
                    {"messages": [{"role": "user", "content": "x"}] * 10_001},
                    {"metadata": {f"k{i}": "v" for i in range(65)}},
                    {"metadata": {"k": _big(1_000_000)}},
                    {"max_cost": -1.0},
                    {"complexity": -(2**70)},
                    {"submitted_at": 1e300},
                ]
            )
            data = _expand_big(_json_bytes({**base, **absurd}), budget)
            shown = _BIG_SHOWN.sub(lambda m: f'"<{int(m[1]) // 10**6} MB>"', json.dumps(absurd))
            if len(shown) > 80:
                shown = shown[:60] + "... (" + str(len(shown)) + " chars)"
            if b"big, past the budget" in data:
                shown += " (sent small: the budget of big payloads was spent)"
            chain.append(_request_part("absurd", data, lvl, header_for(rid), variant=shown))
        elif pick == "replay":
            # The same stored message again (a duplicate id: never stored twice), then
            # the same body without the header (stored again, rejected again).
            body = _json_bytes(base)
            chain.append(_request_part("replay", body, lvl, header_for(rid)))
            chain.append(_request_part("replay", body, lvl, header_for(rid)))
            chain.append(_request_part("replay", body, lvl, None))
        elif pick == "reorder":
            cancel = {
                "v": 2,
                "kind": "cancel_requested",
                "request_id": rid,
                "tenant": EVIL,
                "at": time.time(),
                "reason": "before its request",
            }
            if rng.random() < 0.5:
                # A cancellation before its request: the request must end cancelled.
                chain.append(
                    Part(
                        "reorder",
                        "cancel",
                        cancel_subject(EVIL, rid),
                        _json_bytes(cancel),
                    )
                )
                chain.append(_request_part("reorder", _json_bytes(base), lvl, header_for(rid)))
            else:
                # Rejected (old-style header), then sent again corrected under the same id
                # (issue #30's bug: must not be routed to a worker that drops it).
                chain.append(_request_part("reorder", _json_bytes(base), lvl, rid))
                chain.append(_request_part("reorder", _json_bytes(base), lvl, header_for(rid)))
        elif pick == "cancel_structured":
            over = next(c_iter, None)
            if over is None:
                c_iter = iter(cancels)
                over = next(c_iter, {}) if cancels else {}
            target = rng.choice([rid, new_id()])
            body = {
                "v": 2,
                "kind": "cancel_requested",
                "request_id": target,
                "tenant": EVIL,
                "at": time.time(),
                "reason": "fuzz",
                **over,
            }
            data = _expand_big(_json_bytes(body), budget)
            chain.append(Part("cancel_structured", "cancel", cancel_subject(EVIL, target), data))
        elif pick == "cancel_random":
            data = rng.choice(
                [
                    rng.randbytes(rng.choice([0, 10, 500])),
                    _deep(rng.choice([100, 100_000])),
                    b"null",
                    b"{}",
                    _json_bytes({"kind": "completed", "request_id": rid, "tenant": EVIL}),
                ]
            )
            chain.append(Part("cancel_random", "cancel", cancel_subject(EVIL, rid), data))
        elif pick == "api":
            name = f"fz-{rng.getrandbits(40):010x}"
            options = [
                (
                    f"$JS.API.CONSUMER.CREATE.RQ_EVENTS.{name}.rq.evt.{EVIL}.>",
                    rng.choice(
                        [
                            rng.randbytes(50),
                            b"{}",
                            _deep(10_000),
                            _json_bytes({"stream_name": "RQ_EVENTS", "config": {"name": name}}),
                            _json_bytes(
                                {
                                    "stream_name": "RQ_EVENTS",
                                    "config": {
                                        "name": name,
                                        "filter_subject": f"rq.evt.{GOOD}.>",
                                        "deliver_subject": f"_INBOX_{EVIL}.x",
                                    },
                                }
                            ),
                        ]
                    ),
                ),
                (f"$JS.API.DIRECT.GET.RQ_EVENTS.rq.evt.{EVIL}.{rid}.submitted", b""),
                (f"$JS.API.DIRECT.GET.RQ_TOKENS.rq.tok.{EVIL}.{rid}", rng.randbytes(20)),
                (f"$JS.API.CONSUMER.DELETE.RQ_EVENTS.{name}", b""),
                (f"$JS.API.CONSUMER.DELETE.RQ_TOKENS.{rng.choice(['router-normal', name])}", b""),
            ]
            # A few consumers that deliver globex's own events to the services' core
            # subjects (the body's deliver_subject, which no permission checks).
            if rng.random() < 0.05:
                target = rng.choice(
                    [f"rq.capacity.{BACKEND}", f"rq.boost.{EVIL}", f"rq.preempt.{BACKEND}.ask"]
                )
                options = [
                    (
                        f"$JS.API.CONSUMER.CREATE.RQ_EVENTS.{name}.rq.evt.{EVIL}.>",
                        _json_bytes(
                            {
                                "stream_name": "RQ_EVENTS",
                                "config": {
                                    "name": name,
                                    "filter_subject": f"rq.evt.{EVIL}.>",
                                    "deliver_subject": target,
                                    "deliver_policy": "last",
                                    "ack_policy": "none",
                                    "inactive_threshold": 5_000_000_000,
                                    "mem_storage": True,
                                    "num_replicas": 1,
                                },
                            }
                        ),
                    )
                ]
            subject, data = rng.choice(options)
            chain.append(Part("api", "api", subject, data, api=True, timeout=15.0))
        elif pick == "refused_subject":
            # Subjects the tenant may not publish to: the server refuses them.
            subject = rng.choice(
                [
                    f"rq.req.normal.{GOOD}",
                    f"rq.req.normal.{EVIL}.requeue",
                    f"rq.evt.{EVIL}.{rid}.completed",
                    f"rq.dispatch.{BACKEND}",
                    f"rq.req.urgent.{EVIL}",  # allowed, but no stream listens: no responders
                ]
            )
            chain.append(
                Part(
                    "refused_subject",
                    "refused",
                    subject,
                    _json_bytes(base),
                    {"Nats-Msg-Id": header_for(rid)},
                    ids=[rid],
                    timeout=2.0,
                )
            )
        elif pick == "huge":
            size = rng.choice([1_000_000, 7_900_000, 8 * 1024 * 1024 + 10])
            if budget[0] > 0:
                budget[0] -= 1
                body = {**base, "messages": [{"role": "user", "content": "x" * size}]}
            else:
                body = {**base, "messages": [{"role": "user", "content": "x" * 1000}]}
            chain.append(_request_part("huge", _json_bytes(body), lvl, header_for(rid)))
        chain = chain[: count - sent]  # exactly ``count`` in all
        chains.append(chain)
        sent += len(chain)
    return chains


# ------------------------------------------------------------------------ HTTP


@dataclass
class Shot:
    """One hostile HTTP request, as raw bytes."""

    category: str
    data: bytes
    #: Send this many bytes at a time, ``gap`` seconds apart, for at most ``slow_for``.
    slow: bool = False
    half_close: bool = False


def _http(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    key: str | None,
    headers: list[tuple[str, str]] | None = None,
    length: int | None = None,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body or length is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    for name, value in headers or []:
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def _chat_overrides() -> Any:
    """Hypothesis: field overrides for an otherwise valid OpenAI chat body."""
    from hypothesis import strategies as st  # noqa: PLC0415

    text = st.text(max_size=30)
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
    anyjson = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)
        ),
        max_leaves=8,
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "model": st.one_of(st.sampled_from([ROUTE, "nope", "", "chat.x"]), leaf),
            "messages": st.one_of(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "role": st.one_of(st.sampled_from(["user", "x"]), leaf),
                            "content": anyjson,
                        }
                    ),
                    max_size=3,
                ),
                leaf,
            ),
            "max_tokens": st.one_of(st.integers(), st.sampled_from([2**70, -1, 0]), leaf),
            "temperature": st.one_of(st.floats(), leaf),
            "stream": st.one_of(st.booleans(), leaf),
            "stop": st.one_of(st.lists(text, max_size=5), leaf),
            "seed": st.one_of(st.integers(), st.just(2**70)),
            "n": st.one_of(st.integers(), leaf),
            "tools": anyjson,
            "response_format": anyjson,
            "priority": st.one_of(st.sampled_from([*LEVELS, "urgent"]), leaf),
            "metadata": anyjson,
            "user": leaf,
            "extra_field": anyjson,
        },
    )


def http_plan(count: int, seed: int, mode: Mode, key: str) -> list[Shot]:
    rng = random.Random(seed)
    structured = _hypothesis_draws(_chat_overrides(), count // 4, seed + 2)
    s_iter = iter(structured)
    base = {
        "model": ROUTE,
        "messages": [{"role": "user", "content": "fuzz"}],
        "max_tokens": 4,
    }
    chat = "/v1/chat/completions"
    weights = {
        "structured": 25,
        "bad_json": 15,
        "invalid_key": 15,
        "header_flood": 6,
        "bad_http": 8,
        "half_closed": 6,
        "lying_length": 4,
        "paths": 12,
        "huge_body": 1,
        "absurd": 8,
    }
    names = list(weights)
    picks = rng.choices(names, weights=[weights[k] for k in names], k=count - mode.slow)
    shots: list[Shot] = []
    huge_left = max(2, mode.big // 4)
    for pick in picks:
        if pick == "structured":
            over = next(s_iter, None)
            if over is None:
                s_iter = iter(structured)
                over = next(s_iter, {}) if structured else {}
            body = _json_bytes({**base, **over})
            shots.append(Shot("structured", _http("POST", chat, body, key=key)))
        elif pick == "bad_json":
            good = _json_bytes(base)
            body = rng.choice(
                [
                    good[: rng.randrange(1, len(good))],
                    b"{",
                    b"",
                    b"null",
                    b"[]",
                    b"\xff\xfe\xfd",
                    _deep(rng.choice([1000, 100_000])),
                    b'{"model": "chat", "messages": ' + _deep(50_000) + b"}",
                    b'{"model": "chat", "messages": [{"role": "user", "content": NaN}]}',
                    b'{"model": 1e999, "messages": []}',
                    good.replace(b"messages", b"messages\x00"),
                ]
            )
            shots.append(Shot("bad_json", _http("POST", chat, body, key=key)))
        elif pick == "invalid_key":
            bad = rng.choice(
                [
                    None,
                    "",
                    "rq-" + "x" * 43,
                    "x" * 10_000,
                    "\u00e9\u00e9",
                    key + " ",
                    key[:-1],
                    "Basic " + key,
                ]
            )
            data = _http("POST", chat, _json_bytes(base), key=bad)
            if bad == "Basic " + key:
                data = data.replace(b"Bearer Basic ", b"Basic ")
            shots.append(Shot("invalid_key", data))
        elif pick == "header_flood":
            which = rng.choice(["many", "long", "long_name", "dup_auth"])
            if which == "many":
                extra = [(f"X-F{i}", "v") for i in range(rng.choice([120, 1000, 5000]))]
            elif which == "long":
                extra = [("X-Long", "v" * rng.choice([8000, 20_000, 100_000]))]
            elif which == "long_name":
                extra = [("X" * 9000, "v")]
            else:
                extra = [("Authorization", "Bearer nope")] * 3
            shots.append(
                Shot("header_flood", _http("POST", chat, _json_bytes(base), key=key, headers=extra))
            )
        elif pick == "bad_http":
            data = rng.choice(
                [
                    b"GARBAGE\r\n\r\n",
                    b"POST /v1/chat/completions HTTP/9.9\r\nHost: x\r\n\r\n",
                    b"POST " + b"/a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
                    b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
                    b"Connection: close\r\n\r\nZZZ\r\nxx\r\n0\r\n\r\n",
                    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\n"
                    b"Content-Length: 6\r\nConnection: close\r\n\r\nhello!",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" * 50,
                    rng.randbytes(200),
                ]
            )
            shots.append(Shot("bad_http", data))
        elif pick == "half_closed":
            full = _http("POST", chat, _json_bytes(base), key=key)
            cut = rng.choice([5, 40, len(full) - 3])
            shots.append(Shot("half_closed", full[:cut], half_close=True))
        elif pick == "lying_length":
            body = _json_bytes(base)
            length = rng.choice([len(body) + 100, 10**12, -1, 0])
            shots.append(
                Shot(
                    "lying_length",
                    _http("POST", chat, body, key=key, length=length),
                    half_close=True,
                )
            )
        elif pick == "paths":
            method, path = rng.choice(
                [
                    ("GET", chat),
                    ("PUT", chat),
                    ("POST", "/v1/embeddings"),
                    ("GET", "/v1/../../etc/passwd"),
                    ("GET", "/v1/requests/" + "a" * 5000),
                    ("GET", "/v1/requests/..%2F..%2F"),
                    ("GET", "/v1/requests/x.y.z"),
                    ("GET", "/v1/requests/*"),
                    ("DELETE", "/v1/requests/>"),
                    ("DELETE", "/v1/requests/" + uuid.uuid4().hex),
                    ("GET", "/v1/requests/" + uuid.uuid4().hex + "/stream"),
                    ("GET", "/v1/models/%00"),
                    ("GET", "/console/../../x"),
                    ("OPTIONS", "*"),
                ]
            )
            shots.append(Shot("paths", _http(method, path, key=key)))
        elif pick == "huge_body":
            if huge_left > 0:
                huge_left -= 1
                size = rng.choice([MAX_BODY + 1, 20 * 1024 * 1024])
            else:
                size = 100_000
            body = b'{"model": "chat", "messages": [{"role": "user", "content": "'
            body += b"x" * size + b'"}]}'
            shots.append(Shot("huge_body", _http("POST", chat, body, key=key)))
        elif pick == "absurd":
            absurd = rng.choice(
                [
                    {"stop": ["x" * 2_000_000]},
                    {"seed": 2**70},
                    {"max_tokens": 2**63},
                    {"max_tokens": -1},
                    {"n": 1000},
                    {"temperature": 1e308},
                    {"messages": []},
                    {"messages": [{"role": "user", "content": "x"}] * 10_001},
                    {"priority": "critical"},
                    {"tools": [{"type": "function", "function": {"name": "x" * 10_000}}]},
                ]
            )
            shots.append(
                Shot("absurd", _http("POST", chat, _json_bytes({**base, **absurd}), key=key))
            )
    for _ in range(mode.slow):
        shots.append(
            Shot("slow_sender", _http("POST", chat, _json_bytes(base), key=key), slow=True)
        )
    rng.shuffle(shots)
    return shots


# ---------------------------------------------------------------------- configs


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if not isinstance(value, float) or value == value else "nan"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items())
            + "}"
        )
    return json.dumps(str(value))


def _toml(doc: dict[str, Any]) -> str:
    """A dict as TOML: top-level scalars, then each table as ``[name]`` with inline values."""
    out = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            out.append(f"[{json.dumps(name)}]")
            out += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def _config_shapes() -> Any:
    from hypothesis import strategies as st  # noqa: PLC0415

    text = st.text(max_size=20)
    anyv = st.recursive(
        st.one_of(st.booleans(), st.integers(), st.floats(), text),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)
        ),
        max_leaves=8,
    )
    durations = st.one_of(st.sampled_from(["1s", "-1s", "1e999s", "0s", "10x", "", "1h2m"]), anyv)
    backend = st.fixed_dictionaries(
        {"base_url": st.one_of(st.sampled_from(["http://127.0.0.1:1", "", "ftp://x"]), anyv)},
        optional={
            "model": anyv,
            "adapter": st.one_of(st.sampled_from(["openai", "anthropic", "nope", ""]), anyv),
            "limits": st.one_of(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "concurrency": st.one_of(st.integers(), anyv),
                        "requests": st.one_of(
                            st.sampled_from(["10/min", "0/s", "x/y", "-1/h"]), anyv
                        ),
                    },
                ),
                anyv,
            ),
            "tier": anyv,
            "cost_input_per_mtok": st.one_of(st.floats(), anyv),
            "api_key_env": anyv,
            "api_key_file": st.one_of(st.sampled_from(["/dev/null", "/nonexistent", "/"]), anyv),
        },
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "priorities": st.one_of(st.lists(text, max_size=20), anyv),
            "default_priority": anyv,
            "nats": st.one_of(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "url": anyv,
                        "port": st.one_of(st.integers(), anyv),
                        "duplicate_window": durations,
                        "replicas": anyv,
                    },
                ),
                anyv,
            ),
            "backends": st.one_of(st.dictionaries(text, backend, max_size=3), anyv),
            "routes": st.one_of(
                st.dictionaries(text, st.fixed_dictionaries({"backends": anyv}), max_size=3), anyv
            ),
            "router": st.one_of(st.dictionaries(text, anyv, max_size=3), anyv),
            "worker": st.one_of(
                st.fixed_dictionaries({}, optional={"ack_wait": durations, "max_deliver": anyv}),
                anyv,
            ),
            "gateway": st.one_of(st.dictionaries(text, anyv, max_size=3), anyv),
            "tenants": st.one_of(st.dictionaries(text, anyv, max_size=3), anyv),
            "levels": st.one_of(st.dictionaries(text, anyv, max_size=3), anyv),
            "unknown": anyv,
        },
    )


def config_plan(count: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    original = (ROOT / "renqueue.toml").read_bytes()
    shapes = _hypothesis_draws(_config_shapes(), count // 2, seed + 3)
    files: list[tuple[str, bytes]] = []
    for shape in shapes:
        files.append(("structured", _toml(shape).encode("utf-8", "surrogatepass")))
    while len(files) < count:
        how = rng.choice(["flip", "truncate", "dup_line", "drop_line", "bytes", "deep", "utf8"])
        data = bytearray(original)
        if how == "flip":
            for _ in range(rng.randint(1, 20)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == "truncate":
            data = data[: rng.randrange(len(data))]
        elif how in ("dup_line", "drop_line"):
            lines = original.split(b"\n")
            i = rng.randrange(len(lines))
            if how == "dup_line":
                lines.insert(i, lines[i])
            else:
                del lines[i]
            data = bytearray(b"\n".join(lines))
        elif how == "bytes":
            data = bytearray(rng.randbytes(rng.choice([0, 10, 1000])))
        elif how == "deep":
            depth = rng.choice([500, 5000, 100_000])
            data = bytearray(
                rng.choice(
                    [
                        b"a = " + b"[" * depth + b"]" * depth,
                        b"a = " + b"{b = " * depth + b"1" + b"}" * depth,
                    ]
                )
            )
        else:
            data = bytearray(b'[nats]\nurl = "caf\xe9"\n')
        files.append((how, bytes(data)))
    return files[:count]


# ================================================================ child processes


class Pace:
    """Hands out send times ``1 / rate`` apart, across a sender's tasks (0: no pacing)."""

    def __init__(self, rate: float) -> None:
        self._gap = 1.0 / rate if rate > 0 else 0.0
        self._start = time.monotonic()
        self._n = 0

    async def next(self) -> None:
        if not self._gap:
            return
        due = self._start + self._n * self._gap
        self._n += 1
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def _wait_go() -> None:
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)


async def nats_child(args: argparse.Namespace) -> dict[str, Any]:
    import nats.errors  # noqa: PLC0415

    import nats  # noqa: PLC0415

    mode = MODES[args.mode]
    chains = nats_plan(args.count, args.seed, mode)
    await _wait_go()
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc)[:200])

    nc = await nats.connect(
        args.url,
        user=EVIL,
        password=os.environ["RQ_TENANT_GLOBEX_PASSWORD"],
        inbox_prefix=f"_INBOX_{EVIL}".encode(),
        error_cb=on_error,
        max_reconnect_attempts=-1,
        name="fuzz-hostile",
    )
    js = nc.jetstream()
    results: list[dict[str, Any]] = []
    queue: asyncio.Queue[list[Part]] = asyncio.Queue()
    for chain in chains:
        queue.put_nowait(chain)
    started = time.monotonic()
    pace = Pace(args.rate)

    async def send(part: Part) -> dict[str, Any]:
        out: dict[str, Any] = {
            "category": part.category,
            "kind": part.kind,
            "subject": part.subject,
            "size": len(part.payload),
            "ids": part.ids,
            "variant": part.variant,
        }
        try:
            if part.api:
                reply = await nc.request(part.subject, part.payload, timeout=part.timeout)
                status = (reply.headers or {}).get("Status", "")
                body = reply.data[:300]
                typed = bool(status) or body.startswith(b"{")
                out["outcome"] = "answered" if typed else "answered_untyped"
                out["detail"] = status or body[:120].decode(errors="replace")
            else:
                ack = await js.publish(
                    part.subject, part.payload, headers=part.headers, timeout=part.timeout
                )
                out["outcome"] = "duplicate" if ack.duplicate else "stored"
                out["seq"] = ack.seq
                if part.kind == "cancel":
                    # As the services read it: a cancellation of what its subject names?
                    # (the log's subject for it: RQ_EVENTS sources rq.cancel.<t>.<id>).
                    _, _, tenant, rid = part.subject.split(".", 3)
                    logged = event_subject(tenant, rid, "cancel_requested")
                    out["valid"] = cancel_of(logged, part.payload) is not None
        except nats.errors.MaxPayloadError as exc:
            out["outcome"] = "refused"
            out["detail"] = f"MaxPayloadError: {exc}"[:200]
        except nats.errors.NoRespondersError:
            out["outcome"] = "refused"
            out["detail"] = "no responders"
        except (TimeoutError, nats.errors.TimeoutError):
            out["outcome"] = "no_answer"
        except Exception as exc:  # noqa: BLE001 - every other answer is recorded, typed by name
            out["outcome"] = "refused"
            out["detail"] = f"{type(exc).__name__}: {exc}"[:200]
        return out

    async def worker() -> None:
        while True:
            try:
                chain = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            for part in chain:
                await pace.next()
                results.append(await send(part))

    await asyncio.gather(*(worker() for _ in range(mode.concurrency)))
    elapsed = time.monotonic() - started
    # The consumers it made (some deliver to the services' subjects) are deleted.
    with contextlib.suppress(Exception):
        await nc.flush(timeout=5)
    await nc.drain()
    # A refused publish times out at the publisher while the server's error arrives on
    # the connection: a "no_answer" to a refused subject is the server's refusal.
    violations = sum(1 for e in errors if "permissions violation" in e.lower())
    return {"results": results, "errors": errors[:50], "violations": violations, "elapsed": elapsed}


async def http_child(args: argparse.Namespace) -> dict[str, Any]:
    mode = MODES[args.mode]
    shots = http_plan(args.count, args.seed, mode, args.key)
    await _wait_go()
    results: list[dict[str, Any]] = []
    queue: asyncio.Queue[Shot] = asyncio.Queue()
    for shot in shots:
        queue.put_nowait(shot)
    started = time.monotonic()
    pace = Pace(args.rate)

    async def fire(shot: Shot) -> dict[str, Any]:
        out: dict[str, Any] = {"category": shot.category, "size": len(shot.data)}
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", args.port, limit=2**20), 10.0
            )
        except (OSError, TimeoutError) as exc:
            out["outcome"] = "connect_failed"
            out["detail"] = repr(exc)[:200]
            return out
        try:
            answer = b""
            if shot.slow:
                deadline = time.monotonic() + mode.slow_for
                closed_early = False
                for i in range(len(shot.data)):
                    if time.monotonic() > deadline:
                        break
                    writer.write(shot.data[i : i + 1])
                    try:
                        await writer.drain()
                    except (ConnectionError, OSError):
                        closed_early = True
                        break
                    with contextlib.suppress(TimeoutError):
                        answer += await asyncio.wait_for(reader.read(65536), 0.15)
                        if answer or reader.at_eof():
                            closed_early = True
                            break
                if not closed_early:
                    with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                        answer += await asyncio.wait_for(reader.read(65536), 0.5)
                if not answer and not reader.at_eof():
                    out["outcome"] = "held"  # still waiting for the rest: no read timeout
                    return out
            else:
                writer.write(shot.data)
                try:
                    await writer.drain()
                    if shot.half_close and writer.can_write_eof():
                        writer.write_eof()
                except (ConnectionError, OSError):
                    pass
                try:
                    # A valid request waits its turn in the queue, behind the backlog.
                    answer = await asyncio.wait_for(_read_all(reader), ANSWER_BOUND)
                except TimeoutError:
                    out["outcome"] = "no_answer"
                    return out
                except (ConnectionError, OSError) as exc:
                    out["outcome"] = "reset"
                    out["detail"] = type(exc).__name__
                    return out
            out.update(_classify(answer))
            return out
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def worker() -> None:
        while True:
            try:
                shot = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await pace.next()
            began = time.monotonic()
            result = await fire(shot)
            result["seconds"] = round(time.monotonic() - began, 3)
            results.append(result)

    await asyncio.gather(*(worker() for _ in range(mode.concurrency)))
    return {"results": results, "elapsed": time.monotonic() - started}


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while len(out) < 2**20:
        chunk = await reader.read(65536)
        if not chunk:
            break
        out += chunk
    return out


def _classify(answer: bytes) -> dict[str, Any]:
    if not answer:
        return {"outcome": "closed"}  # the server closed the connection without a word
    head, _, body = answer.partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].decode(errors="replace")
    match = re.match(r"HTTP/1\.[01] (\d{3})", first)
    if not match:
        return {"outcome": "garbled", "detail": first[:100]}
    status = int(match.group(1))
    out: dict[str, Any] = {"status": status}
    shaped = False
    code: Any = None
    with contextlib.suppress(ValueError):
        doc = json.loads(body)
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            shaped = True
            code = doc["error"].get("code")
    if status >= 500:
        out["outcome"] = "server_error"
        out["detail"] = body[:200].decode(errors="replace")
    elif status >= 400:
        out["outcome"] = "typed" if shaped else "plain_4xx"
        out["code"] = code
        if not shaped:
            out["detail"] = body[:100].decode(errors="replace")
    else:
        out["outcome"] = "accepted"
    return out


def config_child(args: argparse.Namespace) -> dict[str, Any]:
    files = config_plan(args.count, args.seed)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    outcomes: Counter[str] = Counter()
    untyped: list[dict[str, Any]] = []
    by_category: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory(prefix="rq-fuzz-config-") as tmp:
        for i, (category, data) in enumerate(files):
            path = Path(tmp) / f"c{i}.toml"
            path.write_bytes(data)
            try:
                load_config(path, environ={})
                outcome = "loaded"
            except ConfigError:
                outcome = "config_error"
            except BaseException as exc:  # noqa: BLE001 - anything else is the finding
                outcome = "untyped"
                if len(untyped) < 20:
                    untyped.append(
                        {
                            "category": category,
                            "error": f"{type(exc).__name__}: {exc}"[:300],
                            "head": data[:200].decode(errors="replace"),
                            "size": len(data),
                        }
                    )
            outcomes[outcome] += 1
            by_category.setdefault(category, Counter())[outcome] += 1
    return {
        "outcomes": dict(outcomes),
        "by_category": {k: dict(v) for k, v in by_category.items()},
        "untyped": untyped,
        "elapsed": time.monotonic() - started,
    }


@dataclass
class Child:
    name: str
    proc: asyncio.subprocess.Process
    out: Path


async def start_child(name: str, argv: list[str], out: Path, env: dict[str, str]) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE),
        "_child",
        name,
        "--out",
        str(out),
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 300.0)
    if line.strip() != b"ready":
        err = b""
        if proc.stderr is not None:
            with contextlib.suppress(TimeoutError):
                err = await asyncio.wait_for(proc.stderr.read(), 5.0)
        raise RuntimeError(f"fuzz child {name} did not start: {line!r} {err[-2000:]!r}")
    return Child(name, proc, out)


async def run_child(child: Child) -> dict[str, Any]:
    assert child.proc.stdin is not None
    child.proc.stdin.write(b"go\n")
    await child.proc.stdin.drain()
    _out, err = await child.proc.communicate()
    if child.proc.returncode != 0 or not child.out.exists():
        raise RuntimeError(
            f"fuzz child {child.name} exited {child.proc.returncode}: "
            + err.decode(errors="replace")[-3000:]
        )
    return await asyncio.to_thread(_read_json, child.out)


def _read_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


# ====================================================================== the stack


@dataclass
class Stack:
    workdir: Path
    server: EmbeddedServer
    service_url: str
    tenant_url: Callable[[str], str]
    metrics_port: int
    gateway_port: int
    keys: dict[str, str]
    up: asyncio.subprocess.Process
    up_log: Path


def _user_url(url: str, user: str, password: str) -> str:
    return url.replace("nats://", f"nats://{user}:{password}@")


def _config_text(service_url: str, mock: str, gateway_port: int, keys: dict[str, str]) -> str:
    lines = [
        "# Written by bench/fuzz.py.",
        "[nats]",
        f'url = "{service_url}"',
        'inbox_prefix = "_INBOX_renqueue"',
        "",
        "[router]",
        'capacity_refresh = "20ms"',
        "",
        "[worker]",
        'retry_delay = "100ms"',
        'drain_timeout = "2s"',
        "",
        f"[backends.{BACKEND}]",
        f'base_url = "{mock}"',
        'model = "mock"',
        f"[backends.{BACKEND}.limits]",
        "concurrency = 16",
        "",
        f"[routes.{ROUTE}]",
        f'backends = ["{BACKEND}"]',
        "",
        "[gateway]",
        f"port = {gateway_port}",
    ]
    for tenant, key in keys.items():
        lines += ["[[gateway.keys]]", f'tenant = "{tenant}"', f'sha256 = "{digest(key)}"']
    return "\n".join(lines) + "\n"


@contextlib.asynccontextmanager
async def stack(workdir: Path) -> AsyncIterator[Stack]:
    os.environ.update(PASSWORDS)  # nats-server reads them from its environment
    async with (
        EmbeddedServer(workdir / "nats", port=-1, config_file=AUTH_CONF) as server,
        mock_process(ttft=0.005, output_tokens=8) as (mock_url, _pid),
    ):
        service_url = _user_url(server.url, "renqueue", PASSWORDS["RQ_SERVICE_PASSWORD"])
        keys = {GOOD: f"rq-fuzz-{uuid.uuid4().hex}", EVIL: f"rq-fuzz-{uuid.uuid4().hex}"}
        gateway_port = free_port()
        metrics_port = free_port()
        config = workdir / "renqueue.toml"
        config.write_text(_config_text(service_url, mock_url, gateway_port, keys))
        up_log = workdir / "up.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENQUEUE_")}
        env["PYTHONUNBUFFERED"] = "1"
        with up_log.open("wb") as out:
            up = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "renqueue", "-c", str(config), "--log-json", "up",
                "--metrics-port", str(metrics_port),
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
            )  # fmt: skip
        try:
            await _until_up(up, up_log, gateway_port, metrics_port)
            yield Stack(
                workdir=workdir,
                server=server,
                service_url=service_url,
                tenant_url=lambda t: _user_url(
                    server.url, t, PASSWORDS[f"RQ_TENANT_{t.upper()}_PASSWORD"]
                ),
                metrics_port=metrics_port,
                gateway_port=gateway_port,
                keys=keys,
                up=up,
                up_log=up_log,
            )
        finally:
            if up.returncode is None:
                up.terminate()
                try:
                    await asyncio.wait_for(up.wait(), 20.0)
                except TimeoutError:
                    up.kill()
                    await up.wait()


def _tail(path: Path, size: int = 3000) -> str:
    return path.read_text(errors="replace")[-size:]


async def _until_up(
    up: asyncio.subprocess.Process, log: Path, gateway_port: int, metrics_port: int
) -> None:
    deadline = time.monotonic() + 120.0
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            if up.returncode is not None:
                raise RuntimeError(f"renqueue up exited {up.returncode}: {_tail(log)}")
            text = _tail(log, 10**9)
            if '"router started"' in text and '"worker started"' in text:
                with contextlib.suppress(httpx.HTTPError):
                    health = await http.get(f"http://127.0.0.1:{gateway_port}/health")
                    scrape = await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
                    if health.status_code == 200 and scrape.status_code == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"renqueue up not ready within 120 s: {_tail(log)}")
            await asyncio.sleep(0.2)


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(timeout=10.0) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def settled_scrape(
    port: int, before: dict[tuple[str, tuple[tuple[str, str], ...]], float], cancels: int
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A scrape once the cancellation watch has counted the ``cancels`` it must drop
    (it reads them on its own loop; bounded: 30 s, then the scrape as it is)."""
    deadline = time.monotonic() + 30.0
    while True:
        after = await scrape(port)
        counted = metric_delta(before, after, "renqueue_misdirected_messages_total")
        if counted.get("receiver=cancels", 0) >= cancels or time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.2)


def metric_delta(
    before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    name: str,
) -> dict[str, float]:
    """``name``'s increase between two scrapes, by its labels (as ``k=v,...``)."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample != name:
            continue
        grew = value - before.get((sample, labels), 0.0)
        if grew:
            out[",".join(f"{k}={v}" for k, v in labels) or "-"] = grew
    return out


# ================================================================== good workload


@dataclass
class Good:
    latencies: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    submitted: int = 0


async def good_workload(
    client: Client,
    rate: float,
    *,
    count: int | None,
    until: asyncio.Event | None,
    result_wait: float,
) -> Good:
    """Open loop at ``rate`` per second: ``count`` requests, or until ``until`` is set
    (and at least ``count``)."""
    good = Good()
    tasks: list[asyncio.Task[None]] = []
    rng = random.Random(7)

    async def one(i: int) -> None:
        start = time.perf_counter()
        request_id = f"good-{uuid.uuid4().hex}"
        try:
            handle = await client.submit(
                f"good request {i}",
                route=ROUTE,
                priority=rng.choice(LEVELS),
                request_id=request_id,
                max_tokens=8,
            )
            await handle.result(timeout=result_wait)
            good.latencies.append(time.perf_counter() - start)
        except TimeoutError:
            good.lost.append(request_id)
        except Exception as exc:  # noqa: BLE001 - every failure is the finding
            good.failed.append(f"{request_id}: {type(exc).__name__}: {exc}"[:300])

    start = time.perf_counter()
    i = 0
    while True:
        if until is None and count is not None and i >= count:
            break
        if until is not None and until.is_set() and (count is None or i >= count):
            break
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    good.submitted = i
    await asyncio.gather(*tasks)
    return good


def latency_summary(good: Good) -> dict[str, Any]:
    return {
        "submitted": good.submitted,
        "completed": len(good.latencies),
        "failed": len(good.failed),
        "not_ended_within_wait": len(good.lost),
        "p50_ms": round(percentile(good.latencies, 50) * 1000, 1),
        "p95_ms": round(percentile(good.latencies, 95) * 1000, 1),
        "p99_ms": round(percentile(good.latencies, 99) * 1000, 1),
        "examples": (good.failed + good.lost)[:5],
    }


# ========================================================================= audit


async def read_stream_subjects(js: Any, stream: str, subject: str) -> list[tuple[str, bytes]]:
    """(subject, data) of every message of ``stream`` under ``subject``, in order (one
    ephemeral pull consumer, no acks; as ``common.read_stream``, with the subjects)."""
    info = await js.stream_info(stream)
    last = int(info.state.last_seq)
    psub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        ),
    )
    out: list[tuple[str, bytes]] = []
    try:
        while True:
            try:
                msgs = await psub.fetch(batch=1000, timeout=2.0)
            except TimeoutError:
                break
            done = False
            for msg in msgs:
                out.append((msg.subject, msg.data))
                meta = msg.metadata
                if meta.num_pending == 0 or meta.sequence.stream >= last:
                    done = True
            if done:
                break
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
    return out


async def audit_nats(
    stack: Stack, nats_report: dict[str, Any], waited: list[str]
) -> dict[str, Any]:
    """The hostile requests' outcomes from the log, and how the good requests whose
    client gave up waiting (``waited``) ended, once the work queues have drained."""
    import nats  # noqa: PLC0415

    nc = await nats.connect(stack.service_url, inbox_prefix=b"_INBOX_renqueue", name="fuzz-audit")
    try:
        js = nc.jetstream()
        # Wait (bounded) for the work queues to drain: the good requests have all
        # ended, so whatever is left is globex's, not yet taken or never acked.
        left = -1
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            left = 0
            for stream in (REQUESTS_STREAM, DISPATCH_STREAM):
                left += int((await js.stream_info(stream)).state.messages)
            if left == 0:
                break
            await asyncio.sleep(0.2)
        events = await read_stream_subjects(js, EVENTS_STREAM, f"rq.evt.{EVIL}.>")
        late: dict[str, str] = {}
        for request_id in waited:
            late[request_id] = "none"
            for kind in TERMINAL_KINDS:
                with contextlib.suppress(Exception):  # not found: not this one
                    await js.get_last_msg(EVENTS_STREAM, f"rq.evt.{GOOD}.{request_id}.{kind}")
                    late[request_id] = kind
                    break
    finally:
        await nc.close()
    terminals: dict[str, list[str]] = {}
    for subject, data in events:
        parts = subject.split(".")
        if len(parts) != 5 or parts[4] not in TERMINAL_KINDS:
            continue
        with contextlib.suppress(msgspec.DecodeError):
            event = EVENT_DECODER.decode(data)
            terminals.setdefault(parts[3], []).append(
                f"{kind_of(event)}:{getattr(event, 'error_type', '')}"
            )
    outcomes: Counter[str] = Counter()
    by_category: dict[str, Counter[str]] = {}
    unaccounted: list[dict[str, Any]] = []
    twice: dict[str, list[str]] = {}
    stored_rejected = 0
    stored_requests = 0
    admitted_ids: set[str] = set()
    admitted_examples: dict[str, list[str]] = {}
    variants: dict[str, Counter[str]] = {}
    valid_cancels = 0
    bad_cancels = 0
    for result in nats_report["results"]:
        outcome = result["outcome"]
        category = result["category"]
        kind = result["kind"]
        verdict = outcome
        if outcome == "stored" and kind == "request":
            stored_requests += 1
            ids = [*result["ids"], f"invalid-{result['seq']}"]
            ended = next((i for i in ids if i in terminals), None)
            if ended is None:
                verdict = "unaccounted"
                if len(unaccounted) < 20:
                    unaccounted.append(
                        {k: result[k] for k in ("category", "subject", "size", "ids", "seq")}
                    )
            else:
                ends = terminals[ended]
                if len(ends) > 1:
                    twice[ended] = ends
                verdict = "ended:" + ends[0]
                if result.get("variant"):
                    key = f"{category}: {result['variant']}"
                    variants.setdefault(key, Counter())[ends[0].rstrip(":")] += 1
                if ends[0].startswith("rejected"):
                    stored_rejected += 1
                else:
                    admitted_ids.add(ended)
                    examples = admitted_examples.setdefault(category, [])
                    if len(examples) < 5:
                        examples.append(f"{ended} {ends[0]}")
        elif outcome == "stored" and kind == "cancel":
            # Decoded as the services decode it.
            verdict = "cancel_valid" if result.get("valid") else "cancel_dropped"
            if result.get("valid"):
                valid_cancels += 1
            else:
                bad_cancels += 1
        elif outcome == "no_answer" and kind == "refused":
            verdict = "refused_by_permissions"
        outcomes[verdict.split(":")[0] if verdict.startswith("ended") else verdict] += 1
        by_category.setdefault(category, Counter())[
            verdict
            if not verdict.startswith("ended")
            else verdict.split(":")[0] + ":" + verdict.split(":")[1]
        ] += 1
    return {
        "left_in_requests_stream": left,
        "outcomes": dict(outcomes),
        "by_category": {k: dict(v) for k, v in sorted(by_category.items())},
        "unaccounted": unaccounted,
        "ended_more_than_once": dict(list(twice.items())[:20]),
        "ended_more_than_once_count": len(twice),
        "stored_requests": stored_requests,
        "stored_and_rejected": stored_rejected,
        "admitted_and_ended": len(admitted_ids),
        "admitted_examples": admitted_examples,
        "outcome_by_variant": {k: dict(v) for k, v in sorted(variants.items())},
        "good_late": late,
        "valid_cancels": valid_cancels,
        "dropped_cancels": bad_cancels,
    }


def log_findings(log: Path) -> dict[str, Any]:
    """What the ``up`` process's log says went wrong: failed loops, gateway 500s,
    tracebacks (by message)."""
    failed_loops: list[str] = []
    gateway_errors: list[str] = []
    errors: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            if "Traceback" in line:
                errors["(a traceback outside the log's JSON)"] += 1
            continue
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            event = str(entry.get("event", ""))
            level = str(entry.get("level", ""))
            if event.startswith("background loop failed"):
                failed_loops.append(f"{entry.get('loop', '')}: {entry.get('error', '')}"[:300])
            if event == "gateway error":
                gateway_errors.append(str(entry.get("exception", ""))[-400:])
            if level in ("error", "critical") or "exception" in entry:
                errors[event[:120]] += 1
    return {
        "failed_loops": failed_loops[:20],
        "failed_loop_count": len(failed_loops),
        "gateway_errors": gateway_errors[:10],
        "gateway_error_count": len(gateway_errors),
        "error_lines": dict(errors.most_common(20)),
    }


# ========================================================================== main


async def run(
    mode: Mode,
    *,
    nats_count: int,
    http_count: int,
    config_count: int,
    seed: int,
    rate: float,
    good_wait: float = 120.0,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="rq-fuzz-"))
    t0 = time.monotonic()
    try:
        async with stack(workdir) as s:
            started = time.monotonic() - t0
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            client = await Client.connect(
                s.tenant_url(GOOD), tenant=GOOD, name="fuzz-good", inbox_prefix=f"_INBOX_{GOOD}"
            )
            try:
                # The senders generate their inputs first, then wait for the word.
                common_args = ["--mode", mode.name, "--seed", str(seed), "--rate", str(rate)]
                children = await asyncio.gather(
                    start_child(
                        "nats",
                        [*common_args, "--count", str(nats_count), "--url", s.server.url],
                        workdir / "nats.json",
                        env,
                    ),
                    start_child(
                        "http",
                        [*common_args, "--count", str(http_count), "--port", str(s.gateway_port),
                         "--key", s.keys[EVIL]],
                        workdir / "http.json",
                        env,
                    ),
                    start_child(
                        "configs",
                        [*common_args, "--count", str(config_count)],
                        workdir / "configs.json",
                        env,
                    ),
                )  # fmt: skip
                # Baseline: the good workload alone.
                load = {"baseline_start": os.getloadavg()[0]}
                baseline = await good_workload(
                    client, mode.rate, count=mode.baseline, until=None, result_wait=good_wait
                )
                before = await scrape(s.metrics_port)
                load["fuzz_start"] = os.getloadavg()[0]
                fuzz_t0 = time.monotonic()
                done = asyncio.Event()
                good_task = asyncio.create_task(
                    good_workload(
                        client, mode.rate, count=mode.baseline, until=done, result_wait=good_wait
                    )
                )
                nats_child_, http_child_, config_child_ = children
                reports = await asyncio.gather(
                    run_child(nats_child_), run_child(http_child_), run_child(config_child_)
                )
                hostile_seconds = time.monotonic() - fuzz_t0
                done.set()
                fuzzed = await good_task
                load["fuzz_end"] = os.getloadavg()[0]
                fuzz_seconds = time.monotonic() - fuzz_t0
            finally:
                await client.close()
            nats_report, http_report, config_report = reports
            audit = await audit_nats(s, nats_report, baseline.lost + fuzzed.lost)
            after = await settled_scrape(s.metrics_port, before, audit["dropped_cancels"])
            rejected = metric_delta(before, after, "renqueue_rejected_total")
            misdirected = metric_delta(before, after, "renqueue_misdirected_messages_total")
            duplicates = metric_delta(before, after, "renqueue_duplicate_completions_total")
            resubmits = metric_delta(before, after, "renqueue_ended_resubmits_total")
            gateway_calls = metric_delta(before, after, "renqueue_gateway_requests_total")
            audit["rejected_metric_delta"] = sum(rejected.values())
            up_alive = s.up.returncode is None
            findings = log_findings(s.up_log)
            shutil.copy(s.up_log, workdir / "up-kept.log")
    finally:
        kept = RESULTS / "fuzz-up.log"
        with contextlib.suppress(OSError):
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(workdir / "up.log", kept)
        shutil.rmtree(workdir, ignore_errors=True)
    http_outcomes = Counter(r["outcome"] for r in http_report["results"])
    http_by_category: dict[str, Counter[str]] = {}
    http_examples: list[dict[str, Any]] = []
    null_codes: Counter[str] = Counter()
    for r in http_report["results"]:
        label = r["outcome"] + (f":{r['status']}" if "status" in r else "")
        http_by_category.setdefault(r["category"], Counter())[label] += 1
        if (
            r["outcome"] in ("server_error", "no_answer", "garbled", "connect_failed")
            and len(http_examples) < 10
        ):
            http_examples.append(r)
        if r["outcome"] == "typed" and r.get("code") is None:
            null_codes[f"{r['category']}:{r['status']}"] += 1
    seconds: dict[str, list[float]] = {}
    for r in http_report["results"]:
        seconds.setdefault(r["category"], []).append(r.get("seconds", 0.0))
    http_seconds = {
        k: {"p50": round(percentile(v, 50), 3), "max": round(max(v), 3)}
        for k, v in sorted(seconds.items())
    }
    http_bad = sum(
        http_outcomes[k] for k in ("server_error", "no_answer", "garbled", "connect_failed")
    )
    crashes = (
        (0 if up_alive else 1) + findings["failed_loop_count"] + findings["gateway_error_count"]
    )
    # A request the client gave up on (120 s) counts unless the log has it completed.
    late_not_completed = sum(1 for kind in audit["good_late"].values() if kind != "completed")
    good_bad = len(fuzzed.failed) + len(baseline.failed) + late_not_completed
    audit["dropped_as_ended"] = sum(duplicates.values())
    audit["refused_as_ended"] = sum(resubmits.values())
    accounted = (
        audit["rejected_metric_delta"]
        + audit["dropped_as_ended"]
        + audit["refused_as_ended"]
        + audit["admitted_and_ended"]
    )
    nats_unaccounted = (
        audit["outcomes"].get("unaccounted", 0)
        + audit["ended_more_than_once_count"]
        + audit["outcomes"].get("no_answer", 0)
        + audit["outcomes"].get("answered_untyped", 0)
        + max(0, audit["left_in_requests_stream"])
        # Every stored request was rejected (counted), admitted and ended (its own
        # terminal event), or admitted though already ended and dropped by a worker.
        + max(0, audit["stored_requests"] - int(accounted))
        + max(0, audit["dropped_cancels"] - int(misdirected.get("receiver=cancels", 0)))
    )
    base_sum = latency_summary(baseline)
    fuzz_sum = latency_summary(fuzzed)
    verdicts = {
        "service_crashes": crashes,
        "good_lost_or_failed": good_bad,
        "hostile_nats_unaccounted": nats_unaccounted,
        "hostile_http_unanswered_or_5xx": http_bad,
        "configs_untyped": config_report["outcomes"].get("untyped", 0),
    }
    return {
        "mode": mode.name,
        "seed": seed,
        "rate": rate,
        "started_in_s": round(started, 1),
        "fuzz_phase_s": round(fuzz_seconds, 1),
        "hostile_senders_s": round(hostile_seconds, 1),
        "counts": {
            "nats": len(nats_report["results"]),
            "http": len(http_report["results"]),
            "configs": sum(config_report["outcomes"].values()),
        },
        "verdicts": verdicts,
        "ok": all(v == 0 for v in verdicts.values()),
        "loadavg_1min": {k: round(v, 2) for k, v in load.items()},
        "latency": {
            "baseline": base_sum,
            "fuzz": fuzz_sum,
            "p50_ratio": round(fuzz_sum["p50_ms"] / base_sum["p50_ms"], 2)
            if base_sum["p50_ms"]
            else None,
            "p95_ratio": round(fuzz_sum["p95_ms"] / base_sum["p95_ms"], 2)
            if base_sum["p95_ms"]
            else None,
        },
        "nats": {
            **audit,
            "server_errors_on_connection": nats_report["errors"][:10],
            "permission_violations": nats_report["violations"],
            "elapsed_s": round(nats_report["elapsed"], 1),
        },
        "http": {
            "outcomes": dict(http_outcomes),
            "by_category": {k: dict(v) for k, v in sorted(http_by_category.items())},
            "typed_with_null_code": dict(null_codes),
            "seconds_by_category": http_seconds,
            "examples": http_examples,
            "elapsed_s": round(http_report["elapsed"], 1),
        },
        "configs": config_report,
        "metrics": {
            "renqueue_rejected_total": rejected,
            "renqueue_misdirected_messages_total": misdirected,
            "renqueue_duplicate_completions_total": duplicates,
            "renqueue_ended_resubmits_total": resubmits,
            "renqueue_gateway_requests_total": gateway_calls,
        },
        "service_log": findings,
        "machine": machine_info(),
    }


VERDICT_LINES = (
    ("service_crashes", "service crashes (exits, failed loops, gateway 500s)"),
    ("good_lost_or_failed", "good requests lost or failed"),
    ("hostile_nats_unaccounted", "hostile NATS without a typed rejection or a count"),
    ("hostile_http_unanswered_or_5xx", "hostile HTTP unanswered, garbled or 5xx"),
    ("configs_untyped", "config files raising anything but ConfigError"),
)


def print_report(report: dict[str, Any]) -> None:
    v = report["verdicts"]
    lat = report["latency"]
    counts = report["counts"]
    print(
        f"\nfuzz ({report['mode']}, seed {report['seed']}, {report['rate']:g}/s each): "
        f"{counts['nats']} NATS messages, {counts['http']} HTTP requests, "
        f"{counts['configs']} config files; fuzz phase {report['fuzz_phase_s']} s"
    )
    for key, label in VERDICT_LINES:
        print(f"  {label:<52} {v[key]:>6}")
    b, f = lat["baseline"], lat["fuzz"]
    print(
        f"  good latency p50 {b['p50_ms']} -> {f['p50_ms']} ms (x{lat['p50_ratio']}), "
        f"p95 {b['p95_ms']} -> {f['p95_ms']} ms (x{lat['p95_ratio']}); "
        f"{b['completed']} alone + {f['completed']} under fuzz completed"
    )
    late = Counter(report["nats"]["good_late"].values())
    if late:
        print(f"  good requests waited for past --good-wait, as they ended: {dict(late)}")
    print(f"  1-minute load average (2 cores shared): {report['loadavg_1min']}")
    n = report["nats"]
    print(f"  NATS outcomes: {n['outcomes']}")
    print(
        f"    stored requests {n['stored_requests']}: rejected {n['stored_and_rejected']} "
        f"(renqueue_rejected_total +{n['rejected_metric_delta']:g}), admitted and ended "
        f"{n['admitted_and_ended']}, dropped by a worker as already ended "
        f"{n['dropped_as_ended']:g}, refused at admission as already ended "
        f"{n['refused_as_ended']:g}; left in RQ_REQUESTS {n['left_in_requests_stream']}; "
        f"cancellations valid {n['valid_cancels']}, dropped {n['dropped_cancels']}"
    )
    admitted = {
        variant: outcomes
        for variant, outcomes in n["outcome_by_variant"].items()
        if any(not outcome.startswith("rejected") for outcome in outcomes)
    }
    if admitted:
        print("    admitted (ended other than rejected), by what was bent:")
        for variant, outcomes in admitted.items():
            print(f"      {variant}: {outcomes}")
    print(f"  HTTP outcomes: {report['http']['outcomes']}")
    if report["http"]["typed_with_null_code"]:
        print(f"    OpenAI-shaped errors with code null: {report['http']['typed_with_null_code']}")
    print(f"  configs: {report['configs']['outcomes']}")
    print(f"  drops counted: {report['metrics']['renqueue_misdirected_messages_total']}")
    print("  verdict: " + ("OK" if report["ok"] else "FAILED"))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--short", action="store_true", help="the short mode (make test runs it)")
    parser.add_argument("--nats", type=int, default=None, help="hostile NATS messages")
    parser.add_argument("--http", type=int, default=None, help="hostile HTTP requests")
    parser.add_argument("--configs", type=int, default=None, help="malformed config files")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument(
        "--good-wait",
        type=float,
        default=120.0,
        help="seconds the good client waits for each result before it looks in the log",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="hostile NATS messages and HTTP requests per second, each (0: as fast as they go)",
    )
    parser.add_argument("--no-save", action="store_true", help="do not write bench/results/")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    mode = MODES["short" if args.short else "full"]
    report = asyncio.run(
        run(
            mode,
            nats_count=args.nats if args.nats is not None else mode.nats,
            http_count=args.http if args.http is not None else mode.http,
            config_count=args.configs if args.configs is not None else mode.configs,
            seed=args.seed,
            rate=args.rate if args.rate is not None else mode.hostile_rate,
            good_wait=args.good_wait,
        )
    )
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        text = json.dumps(report, indent=2, default=str)
        (RESULTS / f"fuzz-{stamp}.json").write_text(text)
        (RESULTS / "fuzz-latest.json").write_text(text)
        print(f"  wrote {RESULTS / 'fuzz-latest.json'}")
    sys.exit(0 if report["ok"] else 1)


def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("which", choices=["nats", "http", "configs"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="full")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--url", default="")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="")
    parser.add_argument("--rate", type=float, default=0.0)
    args = parser.parse_args(argv)
    try:
        if args.which == "nats":
            result = asyncio.run(nats_child(args))
        elif args.which == "http":
            result = asyncio.run(http_child(args))
        else:
            result = config_child(args)
    except BaseException:
        traceback.print_exc()
        raise
    Path(args.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
