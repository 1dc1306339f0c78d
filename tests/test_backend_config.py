"""A backend's ``adapter`` picks its config class: each adapter's options, validated by type.

The config is a msgspec tagged union on ``adapter``: an option of another
adapter is an unknown key, a bad value fails where it is, and a config
without ``adapter`` is the OpenAI-compatible one it always was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from renqueue.backends import make_backend
from renqueue.backends.anthropic import AnthropicBackend
from renqueue.backends.gemini import GeminiBackend
from renqueue.backends.ollama import OllamaBackend
from renqueue.backends.openai import OpenAIBackend
from renqueue.backends.tgi import TGIBackend
from renqueue.config import (
    AnthropicConfig,
    BackendConfig,
    BaseBackendConfig,
    GeminiConfig,
    OllamaConfig,
    TGIConfig,
    load_config,
    parse_config,
)
from renqueue.errors import ConfigError

URL = "http://127.0.0.1:1"


def backend(**fields: Any) -> Any:
    return parse_config({"backends": {"b": {"model": "m", **fields}}}).backends["b"]


def test_a_config_without_adapter_is_openai_as_before() -> None:
    config = backend(base_url=f"{URL}/v1", send_priority=True, limit_style="groq")
    assert type(config) is BackendConfig
    assert config.adapter == "openai"
    assert (config.send_priority, config.limit_style) == (True, "groq")
    assert config == backend(
        adapter="openai", base_url=f"{URL}/v1", send_priority=True, limit_style="groq"
    )


@pytest.mark.parametrize(
    ("adapter", "cls", "base_url"),
    [
        ("anthropic", AnthropicConfig, "https://api.anthropic.com/v1"),
        ("ollama", OllamaConfig, "http://127.0.0.1:11434"),
        ("gemini", GeminiConfig, "https://generativelanguage.googleapis.com/v1beta"),
    ],
)
def test_each_adapter_has_its_class_and_its_providers_base_url_by_default(
    adapter: str, cls: type[BaseBackendConfig], base_url: str
) -> None:
    config = backend(adapter=adapter)
    assert type(config) is cls
    assert config.adapter == adapter
    assert config.base_url == base_url


def test_tgi_needs_its_servers_url() -> None:
    with pytest.raises(ConfigError) as caught:
        backend(adapter="tgi")
    assert caught.value.path == "$.backends.b"
    assert "base_url" in str(caught.value)
    assert type(backend(adapter="tgi", base_url=URL)) is TGIConfig


def test_adapter_options_are_read_typed() -> None:
    anthropic = backend(
        adapter="anthropic",
        anthropic_version="2023-06-01",
        max_tokens=512,
        beta=["output-128k-2025-02-19"],
    )
    assert (anthropic.max_tokens, anthropic.beta) == (512, ["output-128k-2025-02-19"])
    ollama = backend(adapter="ollama", keep_alive=-1, options={"num_ctx": 4096, "stop": ["\n"]})
    assert ollama.keep_alive == -1
    assert msgspec.to_builtins(ollama.options) == {"num_ctx": 4096, "stop": ["\n"]}
    tgi = backend(
        adapter="tgi",
        base_url=URL,
        prompt_format="llama3",
        parameters={"top_k": 20, "repetition_penalty": 1.1},
    )
    assert (tgi.prompt_format, tgi.parameters.top_k) == ("llama3", 20)
    gemini = backend(
        adapter="gemini",
        top_k=8,
        safety_settings=[{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}],
    )
    assert gemini.safety_settings[0].threshold == "BLOCK_NONE"


@pytest.mark.parametrize(
    ("fields", "path", "words"),
    [
        ({"adapter": "bedrock"}, "$.backends.b.adapter", "unknown adapter 'bedrock'"),
        ({"adapter": 3}, "$.backends.b.adapter", "unknown adapter 3"),
        # Another adapter's option, named with the adapter this one is.
        (
            {"adapter": "anthropic", "send_priority": True},
            "$.backends.b",
            "unknown field `send_priority`: not an option of adapter 'anthropic'",
        ),
        (
            {"base_url": f"{URL}/v1", "keep_alive": "5m"},
            "$.backends.b",
            "unknown field `keep_alive`: not an option of adapter 'openai'",
        ),
        (
            {"adapter": "anthropic", "max_tokens": 0},
            "$.backends.b.max_tokens",
            ">= 1",
        ),
        (
            {"adapter": "anthropic", "anthropic_version": "2023-06-01\r\nX-Evil: 1"},
            "$.backends.b.anthropic_version",
            "match",
        ),
        (
            {"adapter": "ollama", "options": {"num_ctx": "big"}},
            "$.backends.b.options.num_ctx",
            "Expected `int | null`",
        ),
        (
            {"adapter": "ollama", "options": {"num_gpus": 1}},
            "$.backends.b.options",
            "unknown field `num_gpus`",
        ),
        ({"adapter": "ollama", "keep_alive": "forever"}, "$.backends.b.keep_alive", "match"),
        (
            {"adapter": "tgi", "base_url": URL, "prompt_format": "alpaca"},
            "$.backends.b.prompt_format",
            "Invalid enum value 'alpaca'",
        ),
        (
            {"adapter": "tgi", "base_url": URL, "parameters": {"top_p": 1.0}},
            "$.backends.b.parameters.top_p",
            "< 1.0",
        ),
        (
            {"adapter": "gemini", "safety_settings": [{"category": "HARM_CATEGORY_X"}]},
            "$.backends.b.safety_settings[0]",
            "missing required field `threshold`",
        ),
        (
            {"adapter": "gemini", "base_url": "generativelanguage.googleapis.com"},
            "$.backends.b",
            "http://",
        ),
    ],
)
def test_bad_adapter_options_fail_at_load_naming_their_path(
    fields: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        backend(**fields)
    assert caught.value.path == path
    assert words in str(caught.value)


def test_a_backend_that_is_not_a_table_is_an_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"backends": {"b": "openai"}})
    assert caught.value.path == "$.backends.b"


def test_the_toml_file_names_the_adapter_and_the_error_the_file(tmp_path: Path) -> None:
    file = tmp_path / "renqueue.toml"
    file.write_text(
        '[backends.claude]\nadapter = "anthropic"\nmodel = "claude-sonnet-4-5"\n'
        'api_key_env = "ANTHROPIC_API_KEY"\nmax_tokens = 2048\n'
        '[backends.local]\nadapter = "ollama"\nmodel = "llama3.2"\nkeep_alive = "30m"\n'
        "[backends.local.options]\nnum_ctx = 8192\n"
        '[routes.chat]\nbackends = ["local", "claude"]\n'
    )
    config = load_config(file)
    assert type(config.backends["claude"]) is AnthropicConfig
    assert type(config.backends["local"]) is OllamaConfig
    file.write_text('[backends.local]\nadapter = "ollama"\nmodel = "m"\nprompt_format = "x"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(file)
    assert str(caught.value).startswith(f"{file}: ")
    assert "not an option of adapter 'ollama'" in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "cls"),
    [
        ({"base_url": f"{URL}/v1"}, OpenAIBackend),
        ({"adapter": "anthropic"}, AnthropicBackend),
        ({"adapter": "ollama"}, OllamaBackend),
        ({"adapter": "tgi", "base_url": URL}, TGIBackend),
        ({"adapter": "gemini"}, GeminiBackend),
    ],
)
async def test_make_backend_builds_the_adapter_the_config_class_names(
    fields: dict[str, Any], cls: type
) -> None:
    built = make_backend("b", backend(**fields))
    assert type(built) is cls
    await built.close()


def test_the_union_round_trips_through_builtins() -> None:
    config = parse_config(
        {
            "backends": {
                "a": {"adapter": "anthropic", "model": "m"},
                "o": {"base_url": f"{URL}/v1", "model": "m"},
            }
        }
    )
    raw = msgspec.to_builtins(config.backends)
    assert raw["a"]["adapter"] == "anthropic"
    assert raw["o"]["adapter"] == "openai"
    assert parse_config({"backends": raw}).backends == config.backends


async def test_a_gemini_model_may_be_named_as_googles_resource() -> None:
    built = make_backend("b", backend(adapter="gemini", model="models/gemini-2.0-flash"))
    assert isinstance(built, GeminiBackend)
    assert built._urls == (
        "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash"
        ":streamGenerateContent?alt=sse",
        "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.0-flash:generateContent",
    )
    await built.close()


@pytest.mark.parametrize("key", [None, "RQ_TEST_KEY"])
def test_a_base_url_with_credentials_fails_at_load_without_echoing_them(key: str | None) -> None:
    """A base_url with ``user:password@`` failed every call with aiohttp's bare
    ValueError when the adapter sends its key header too ("Cannot combine
    AUTHORIZATION header with ... credentials encoded in URL"), and its password
    would reach logs and errors with the URL (repr, messages). Refused at load,
    naming the rule, never the password."""
    with pytest.raises(ConfigError) as caught:
        backend(base_url="http://user:s3cr3t-pw@127.0.0.1:8000/v1", api_key_env=key)
    assert caught.value.path == "$.backends.b"
    assert "credentials" in str(caught.value)
    assert "s3cr3t" not in str(caught.value)
    assert "s3cr3t" not in repr(caught.value)
