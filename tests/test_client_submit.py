"""Client.submit takes typed keyword-only options: a wrong one fails at the call."""

from __future__ import annotations

import inspect

import pytest

from renqueue import Client
from renqueue.wire import Connection


async def test_a_misspelt_option_is_a_type_error_at_the_call(nc: Connection) -> None:
    client = Client(nc)
    # Raised by the call itself, before there is a coroutine to await: nothing
    # is built or published, and mypy reports the same line.
    with pytest.raises(TypeError, match="max_token"):
        client.submit("hi", route="chat", max_token=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        client.submit("hi", "chat")  # type: ignore[misc]
    with pytest.raises(TypeError, match="route"):
        client.submit("hi")  # type: ignore[call-arg]


def test_submit_and_build_request_take_the_same_options() -> None:
    submit = list(inspect.signature(Client.submit).parameters.values())
    build = list(inspect.signature(Client.build_request).parameters.values())
    assert submit == build
    options = submit[2:]
    assert options
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options)


def test_every_option_of_submit_is_documented() -> None:
    doc = inspect.getdoc(Client.submit) or ""
    for name in list(inspect.signature(Client.submit).parameters)[1:]:
        assert f"    {name}: " in doc, name
