"""Config validation: every bad value fails at load time, naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from renqueue import Client, Services
from renqueue.config import load_config, parse_config, parse_duration, parse_rate
from renqueue.errors import ConfigError
from renqueue.mock import MockBackend, MockSettings

BACKEND = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        ({"nats": {"port": "x"}}, "$.nats.port", "Expected `int`"),
        ({"nats": {"replicas": 7}}, "$.nats.replicas", "<= 5"),
        ({"nats": {"prot": 1}}, "$.nats", "unknown field `prot`"),
        ({"backends": {"a": {"model": "m"}}}, "$.backends.a", "missing required field `base_url`"),
        ({"backends": {"a": {**BACKEND, "base_url": "ftp://x"}}}, "$.backends.a", "http://"),
        (
            {"backends": {"a": {**BACKEND, "limits": {"concurrency": 0}}}},
            "$.backends.a.limits.concurrency",
            ">= 1",
        ),
        (
            {"backends": {"a": {**BACKEND, "limits": {"requests": ["often"]}}}},
            "$.backends.a.limits",
            "invalid rate 'often'",
        ),
        (
            {"backends": {"a": {**BACKEND, "limits": {"requests": ["1000/7d"]}}}},
            "$.backends.a.limits",
            "longer than 2 days",
        ),
        (
            {"backends": {"a": {**BACKEND, "limits": {"daily_reset": "cet"}}}},
            "$.backends.a.limits.daily_reset",
            "Invalid enum value 'cet'",
        ),
        ({"backends": {"a": {**BACKEND, "timeout": "soon"}}}, "$.backends.a.timeout", "match"),
        (
            {"backends": {"a": {**BACKEND, "limit_style": "grok"}}},
            "$.backends.a.limit_style",
            "Invalid enum value 'grok'",
        ),
        ({"backends": {"bad.name": BACKEND}}, "$.backends.bad.name", "invalid name"),
        # "^...$" matches before a final newline: a name is its characters, nothing after.
        ({"backends": {"gpu\n": BACKEND}}, "$.backends.gpu\n", "invalid name"),
        (
            {"backends": {"a": BACKEND}, "routes": {"r\n": {"backends": ["a"]}}},
            "$.routes.r\n",
            "invalid name",
        ),
        (
            {"backends": {"a": BACKEND}, "routes": {"r": {"backends": ["a", "zz"]}}},
            "$.routes.r.backends[1]",
            "unknown backend 'zz'",
        ),
        ({"routes": {"r": {"backends": []}}}, "$.routes.r.backends", "length >= 1"),
        ({"priorities": ["a", "a"], "default_priority": "a"}, "$.priorities", "unique"),
        ({"default_priority": "urgent"}, "$.default_priority", "'urgent'"),
        ({"worker": {"quota_hold": "500ms"}}, "$.worker", "quota_hold (500ms) must be at least 1s"),
        ({"worker": {"quota_hold": "0s"}}, "$.worker", "quota_hold (0s) must be at least 1s"),
    ],
)
def test_invalid_config_names_the_field(data: dict[str, object], path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.path == path
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("data", "path", "hint"),
    [
        ({"nats": {"prot": 1}}, "$.nats", "did you mean `port`?"),
        ({"routr": {}}, "$", "did you mean `router`?"),
        (
            {"backends": {"a": {**BACKEND, "limits": {"concurency": 2}}}},
            "$.backends.a.limits",
            "did you mean `concurrency`?",
        ),
        # Put one table too high: the key it belongs under is named.
        ({"backends": {"a": {**BACKEND, "concurency": 2}}}, "$.backends.a", "`limits.concurrency`"),
        (
            {"backends": {"a": {**BACKEND, "adapter": "ollama", "optons": {}}}},
            "$.backends.a",
            "did you mean `options`?",
        ),
        (
            {"backends": {"a": BACKEND}, "routes": {"r": {"backends": ["a"], "fallbak": {}}}},
            "$.routes.r",
            "did you mean `fallback`?",
        ),
        (
            {
                "backends": {"a": BACKEND},
                "routes": {"r": {"backends": ["a"], "fallback": {"attemps": 2}}},
            },
            "$.routes.r.fallback",
            "did you mean `attempts`?",
        ),
        ({"gateway": {"keys": [{"tenant": "t", "sha265": "x"}]}}, "$.gateway.keys[0]", "`sha256`"),
        ({"tenants": {"*": {"budgte": 1}}}, "$.tenants.*", "did you mean `budget`?"),
    ],
)
def test_an_unknown_key_suggests_the_closest_known_one(
    data: dict[str, object], path: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.path == path
    assert "unknown field" in str(info.value)
    assert hint in str(info.value)


def test_an_unknown_key_like_no_known_one_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"router": {"zzzzzz": 1}})
    assert "did you mean" not in str(info.value)


def test_the_documented_typo_error_is_what_a_typo_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("renqueue.toml").write_text(
        '[backends.groq]\nbase_url = "http://127.0.0.1:1/v1"\nmodel = "m"\n'
        "[backends.groq.limits]\nconcurency = 4\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(Path("renqueue.toml"), environ={})
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    assert f"renqueue: {info.value}\n" in docs


def test_quota_hold_of_a_second_or_more_is_taken() -> None:
    assert parse_config({"worker": {"quota_hold": "1s"}}).worker.failure_policy().quota_hold == 1.0
    assert parse_config({}).worker.failure_policy().quota_hold == 600.0


def test_example_config_file_is_valid() -> None:
    config = load_config(Path(__file__).parents[1] / "renqueue.toml", environ={})
    assert config.routes
    for route in config.routes.values():
        assert all(name in config.backends for name in route.backends)


def test_env_overrides_nats_url(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text('[nats]\nurl = "nats://file:4222"\n')
    config = load_config(file, environ={"RENQUEUE_NATS_URL": "nats://env:4222"})
    assert config.nats.url == "nats://env:4222"


def test_bad_toml_and_missing_file_fail_with_the_file_name(tmp_path: Path) -> None:
    file = tmp_path / "broken.toml"
    file.write_text("[nats\n")
    with pytest.raises(ConfigError, match=r"broken\.toml: not valid TOML"):
        load_config(file, environ={})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.toml", environ={})


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        # tomllib parses by recursion: nesting past Python's limit was a RecursionError
        # (found by bench/fuzz.py's malformed configs).
        ("arrays.toml", b"a = " + b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        ("tables.toml", b"a = " + b"{b = " * 5000 + b"1" + b"}" * 5000, "nested too deeply"),
        # Not UTF-8: read_text's UnicodeDecodeError (a ValueError, not an OSError) escaped.
        ("latin1.toml", b'[nats]\nurl = "caf\xe9"\n', "not UTF-8"),
    ],
)
def test_a_config_file_too_deep_or_not_utf8_is_a_config_error(
    tmp_path: Path, name: str, content: bytes, says: str
) -> None:
    file = tmp_path / name
    file.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"{name.replace('.', chr(92) + '.')}: .*{says}"):
        load_config(file, environ={})


def test_a_config_file_past_the_bound_is_refused_unread(tmp_path: Path) -> None:
    """A config file was read whole, whatever its size: 300 MB took 21 s and
    650 MB of memory before it failed, and `-c /dev/zero` never ended. A file
    past renqueue.config.MAX_CONFIG_BYTES (16 MiB; a config is a few KiB) is
    refused at once."""
    bound = 16 * 1024 * 1024
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"#" * bound + b"\n")
    with pytest.raises(ConfigError, match=r"huge\.toml: over 16 MiB: not a config file"):
        load_config(huge, environ={})
    with pytest.raises(ConfigError, match=r"/dev/zero: over 16 MiB"):
        load_config("/dev/zero", environ={})
    just = tmp_path / "just.toml"
    just.write_bytes(b"#" * (bound - 1) + b"\n")
    assert load_config(just, environ={}).routes == {}


def test_api_key_comes_from_env_and_never_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"backends": {"a": {**BACKEND, "api_key_env": "RQ_TEST_KEY"}}})
    monkeypatch.setenv("RQ_TEST_KEY", "sk-live-SECRET")
    key = config.backends["a"].api_key()
    assert key is not None
    assert key.reveal() == "sk-live-SECRET"
    assert "SECRET" not in repr(key)
    assert "SECRET" not in str(key)
    assert "SECRET" not in repr(config)
    monkeypatch.delenv("RQ_TEST_KEY")
    with pytest.raises(ConfigError, match="RQ_TEST_KEY is not set"):
        config.backends["a"].api_key()


def test_durations_and_rates_parse() -> None:
    assert parse_duration("250ms") == 0.25
    assert parse_duration("2h") == 7200
    assert parse_rate("30/min").count == 30
    assert parse_rate("30/min").window == 60
    assert parse_rate("1000/1d").window == 86400
    with pytest.raises(ValueError, match="invalid rate"):
        parse_rate("0/min")


def test_limit_style_defaults_to_auto_and_takes_a_dialect() -> None:
    config = parse_config({"backends": {"a": BACKEND, "g": {**BACKEND, "limit_style": "groq"}}})
    assert config.backends["a"].limit_style == "auto"
    assert config.backends["g"].limit_style == "groq"


def test_cost_is_per_million_tokens() -> None:
    config = parse_config(
        {"backends": {"a": {**BACKEND, "cost_input_per_mtok": 1.0, "cost_output_per_mtok": 2.0}}}
    )
    assert config.backends["a"].cost(1_000_000, 500_000) == pytest.approx(2.0)


async def test_a_backend_without_its_key_is_taken_out_and_the_rest_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RQ_TEST_MISSING_KEY", raising=False)
    async with MockBackend(MockSettings(ttft=0.0, tokens_per_second=0, output_tokens=2)) as mock:
        raw = {
            "nats": {"data_dir": str(tmp_path / "nats"), "port": -1},
            "backends": {
                "cloud": {"base_url": mock.url, "model": "m", "api_key_env": "RQ_TEST_MISSING_KEY"},
                "local": {"base_url": mock.url, "model": "m"},
            },
            "routes": {
                "chat": {"backends": ["cloud", "local"]},
                "cloud-only": {"backends": ["cloud"]},
            },
        }
        async with Services(parse_config(raw)) as services:
            assert [w.backend_name for w in services.workers] == ["local"]
            assert list(services.config.routes) == ["chat"]
            async with Client(services.nc, tenant="t") as client:
                result = await (await client.submit("hi", route="chat")).result(timeout=10)
        assert result.backend == "local"

        raw["backends"]["cloud"]["required"] = True  # type: ignore[index]
        with pytest.raises(ConfigError, match=r"\$\.backends\.cloud\.api_key_env"):
            await Services(
                parse_config({**raw, "nats": {"data_dir": str(tmp_path / "n2")}})
            ).start()
        assert not (tmp_path / "n2").exists()  # nothing was started


def test_the_gateways_time_outs_have_defaults_and_bounds() -> None:
    assert parse_config({}).gateway.timeouts == (10.0, 30.0, 75.0)
    assert parse_config({}).gateway.max_in_flight_per_key == 256
    given = {"header_timeout": "2s", "body_timeout": "500ms", "idle_timeout": "1m"}
    assert parse_config({"gateway": given}).gateway.timeouts == (2.0, 0.5, 60.0)
    assert parse_config({}).gateway.send_timeout == "60s"
    for name in ("header_timeout", "body_timeout", "idle_timeout", "send_timeout"):
        for value in ("0s", "2h"):
            with pytest.raises(ConfigError, match=f"gateway {name} must be between"):
                parse_config({"gateway": {name: value}})
