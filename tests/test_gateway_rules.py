"""The gateway's pure rules, without a server: body translation, controls from
headers, error mapping, API keys, retry memory, resume ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from renqueue import ConfigError, parse_config
from renqueue.errors import MalformedRequestError, NatsApiError, NatsTimeoutError
from renqueue.gateway import ApiError, KeyStore, digest, new_key
from renqueue.gateway._errors import from_error, from_terminal
from renqueue.gateway._idempotency import RetryMemory, fingerprint, id_for_key
from renqueue.gateway._openai import chunk_bytes, completion_bytes, parse_chat, translate
from renqueue.gateway._server import parse_last_event_id
from renqueue.policy._budget import day_ends
from renqueue.wire import Cancelled, Expired, Failed, Rejected

LEVELS = ["critical", "high", "normal", "low", "batch"]
NOW = 1_800_000_000.0


def submit(body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    base = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    chat = parse_chat(json.dumps({**base, **body}).encode())
    return translate(chat, headers or {}, levels=LEVELS, default_level="normal", now=NOW)


def refused(body: dict[str, Any], headers: dict[str, str] | None = None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        submit(body, headers)
    assert caught.value.status == 400
    return caught.value


# ------------------------------------------------------------------- the body


def test_what_the_wire_carries_is_translated() -> None:
    sub = submit(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok"},
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": "END",
            "seed": 3,
            "user": "u-1",
            "metadata": {"team": "x"},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert sub.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    ]
    assert (sub.max_tokens, sub.temperature, sub.top_p, sub.stop, sub.seed) == (
        7,
        0.5,
        0.9,
        ["END"],
        3,
    )
    assert sub.metadata == {"team": "x", "user": "u-1"}
    assert sub.stream
    assert sub.include_usage
    assert sub.priority == "normal"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 3}, "n"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"store": True}, "store"),
        ({"top_k": 3}, "top_k"),
        ({"tenant": "other"}, "tenant"),
        ({"messages": [{"role": "tool", "content": "r", "tool_call_id": "c"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
)
def test_what_the_wire_cannot_carry_is_refused_naming_the_field(
    body: dict[str, Any], param: str
) -> None:
    assert refused(body).param == param


def test_neutral_values_ask_for_nothing_and_pass() -> None:
    sub = submit(
        {
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "logprobs": False,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "response_format": {"type": "text"},
            "logit_bias": {},
            "modalities": ["text"],
            "store": False,
            "service_tier": "auto",
            "temperature": None,
        }
    )
    assert sub.route == "chat"


def test_malformed_and_hostile_bodies_are_400s_not_crashes() -> None:
    for body in (b"", b"{", b"[]", b"\xff", b'{"model": "chat"}', b"[" * 50_000 + b"]" * 50_000):
        with pytest.raises(ApiError) as caught:
            parse_chat(body)
        assert caught.value.status == 400
    deep = b'{"model": "c", "messages": [], "tools": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(ApiError):
        parse_chat(deep)


# ----------------------------------------------------------------- controls


def test_priority_from_a_header_a_level_name_or_vllms_integer() -> None:
    assert submit({}, {"X-Priority": "high"}).priority == "high"
    assert submit({"priority": "low"}).priority == "low"
    # vLLM's integer: 0 is the default level, lower is more urgent, clamped.
    assert submit({"priority": 0}).priority == "normal"
    assert submit({"priority": -1}).priority == "high"
    assert submit({"priority": -10}).priority == "critical"
    assert submit({"priority": 2}).priority == "batch"
    assert submit({"priority": 99}).priority == "batch"
    assert submit({}, {"X-Priority": "-1"}).priority == "high"
    # The header wins over the body.
    assert submit({"priority": "batch"}, {"X-Priority": "critical"}).priority == "critical"
    assert refused({}, {"X-Priority": "asap"}).param == "X-Priority"
    assert refused({"priority": "asap"}).code == "unknown_priority"


def test_deadline_timeout_cost_and_keep_from_headers_or_body() -> None:
    sub = submit({}, {"X-Deadline": str(NOW + 100), "X-Max-Cost": "0.25"})
    assert (sub.deadline, sub.max_cost) == (NOW + 100, 0.25)
    assert submit({"request_timeout": 30}).deadline == NOW + 30
    # Both: the earlier one.
    assert submit({"deadline": NOW + 100}, {"X-Request-Timeout": "10"}).deadline == NOW + 10
    assert submit({"max_cost": 2}).max_cost == 2
    assert submit({}).keep_alive_on_disconnect is None
    assert submit({}, {"X-Keep-Alive-On-Disconnect": "true"}).keep_alive_on_disconnect
    assert submit({"keep_alive_on_disconnect": False}).keep_alive_on_disconnect is False
    for name, value in (
        ("X-Deadline", "soon"),
        ("X-Request-Timeout", "-3"),
        ("X-Max-Cost", "inf"),
        ("X-Keep-Alive-On-Disconnect", "perhaps"),
    ):
        assert refused({}, {name: value}).param == name


# ------------------------------------------------------------------ responses


def test_chunks_and_completions_have_openais_shape() -> None:
    plain = json.loads(chunk_bytes("r1", "chat", 5, content="hi"))
    assert plain == {
        "id": "r1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "chat",
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
        ],
    }
    with_usage = json.loads(chunk_bytes("r1", "chat", 5, finish="stop", with_usage=True))
    assert with_usage["usage"] is None
    assert with_usage["choices"][0]["delta"] == {}
    whole = json.loads(
        completion_bytes(
            "r1", "chat", 5, text="x", finish="weird", prompt_tokens=2, completion_tokens=3
        )
    )
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


# --------------------------------------------------------------------- errors


def test_terminal_events_map_to_statuses() -> None:
    base: dict[str, Any] = {"request_id": "r", "tenant": "t", "at": NOW}
    budget = from_terminal(
        Rejected(**base, error_type="budget_exhausted", reason="spent"), now=NOW + 60
    )
    assert (budget.status, budget.code) == (429, "budget_exhausted")
    assert budget.retry_after == day_ends(NOW) - (NOW + 60)
    assert budget.headers()["x-should-retry"] == "false"
    assert (
        from_terminal(Rejected(**base, error_type="unknown_route", reason=""), now=NOW).status
        == 404
    )
    assert (
        from_terminal(Rejected(**base, error_type="over_cost_cap", reason=""), now=NOW).param
        == "max_cost"
    )
    assert from_terminal(Expired(**base, stage="queued"), now=NOW).status == 504
    assert from_terminal(Cancelled(**base, stage="running"), now=NOW).status == 409
    failed = {
        "context_length": 400,
        "overloaded": 503,
        "quota_exhausted": 503,
        "server_error": 502,
        "broken_stream": 502,
    }
    for error_class, status in failed.items():
        event = Failed(**base, error_type="x", reason="y", error_class=error_class)
        assert from_terminal(event, now=NOW).status == status, error_class


def test_exceptions_map_to_statuses_without_details() -> None:
    assert from_error(NatsTimeoutError("slow")).status == 503
    full = from_error(NatsApiError("maximum messages exceeded", status=503, err_code=10077))
    assert (full.status, full.retry_after) == (429, 1.0)
    assert (
        from_error(MalformedRequestError("Expected `float` - at `$.params.top_p`")).param == "top_p"
    )
    secret = from_error(RuntimeError("password=hunter2"))
    assert secret.status == 500
    assert "hunter2" not in secret.message
    assert json.loads(secret.body())["error"].keys() == {"message", "type", "param", "code"}


# ----------------------------------------------------------------------- keys


def test_keys_are_stored_hashed_and_map_to_tenants(tmp_path: Path) -> None:
    key = new_key()
    other = new_key()
    assert key.startswith("rq-")
    assert len(key) > 40
    file = tmp_path / "keys"
    file.write_text(f"# team keys\nsha256:{digest(other)} globex\n\n")
    config = parse_config(
        {"gateway": {"keys": [{"tenant": "acme", "sha256": digest(key)}], "keys_file": str(file)}}
    )
    store = KeyStore.from_config(config.gateway)
    assert store.tenant_of(key) == "acme"
    assert store.tenant_of(other) == "globex"
    assert store.tenant_of("rq-guess") is None
    assert store.tenant_of("") is None
    assert store.tenant_of("x" * 10_000) is None
    assert store.tenants == {"acme", "globex"}


def test_a_bad_keys_file_fails_at_start_without_showing_the_line(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text("rq-plaintext-key-pasted-here acme\n")
    config = parse_config({"gateway": {"keys_file": str(file)}})
    with pytest.raises(ConfigError) as caught:
        KeyStore.from_config(config.gateway)
    assert "line 1" in str(caught.value)
    assert "rq-plaintext" not in str(caught.value)
    assert caught.value.path == "$.gateway.keys_file"
    with pytest.raises(ConfigError):
        KeyStore.from_config(parse_config({"gateway": {"keys_file": str(tmp_path / "no")}}).gateway)
    with pytest.raises(ConfigError) as bad:
        parse_config({"gateway": {"keys": [{"tenant": "acme", "sha256": "not-hex"}]}})
    assert bad.value.path.startswith("$.gateway.keys")


def test_one_digest_for_two_tenants_is_refused() -> None:
    sha = digest("k")
    config = parse_config(
        {"gateway": {"keys": [{"tenant": "a", "sha256": sha}, {"tenant": "b", "sha256": sha}]}}
    )
    with pytest.raises(ConfigError):
        KeyStore.from_config(config.gateway)


# ---------------------------------------------------------------- idempotency


def test_a_key_names_the_same_request_id_everywhere() -> None:
    assert id_for_key("k1") == id_for_key("k1")
    assert id_for_key("k1") != id_for_key("k2")
    assert len(id_for_key("x" * 255)) <= 128
    assert fingerprint("a", b"{}") != fingerprint("b", b"{}")


def test_retry_memory_forgets_after_its_ttl_and_past_its_size() -> None:
    now = [0.0]
    memory = RetryMemory(10.0, size=2, clock=lambda: now[0])
    memory.remember("a", "r1")
    now[0] = 5.0
    memory.remember("b", "r2")
    assert memory.recall("a") == "r1"
    now[0] = 10.5
    assert memory.recall("a") is None
    assert memory.recall("b") == "r2"
    memory.remember("c", "r3")
    memory.remember("d", "r4")
    assert len(memory) == 2
    assert memory.recall("b") is None


# ------------------------------------------------------------------ resume ids


def test_last_event_ids_parse_or_are_refused() -> None:
    assert parse_last_event_id(None).stage == "start"
    assert parse_last_event_id("0").stage == "role"
    assert parse_last_event_id("2.17") == parse_last_event_id(" 2.17 ")
    assert (parse_last_event_id("2.17").delivery, parse_last_event_id("2.17").seq) == (2, 17)
    assert parse_last_event_id("end").stage == "end"
    for bad in ("x", "1.", ".1", "1.2.3", "9" * 30 + ".1"):
        with pytest.raises(ApiError):
            parse_last_event_id(bad)
