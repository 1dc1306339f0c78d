"""What a request needs of a backend beyond text in, text out.

Not every backend can do everything the wire carries: a local text model
reads no images, TGI's generate API has no tools, Anthropic's Messages API
has no logprobs. A request is routed only to backends that can do what it
asks (:func:`needs` within the backend's ``features``), never sent to one
that would drop it silently or refuse it:

========================  ==================================================
feature                   a request needs it when it has
========================  ==================================================
``tools``                 tools, or messages with tool calls or tool results
``vision``                image content parts
``json``                  ``response_format`` ``json_object``
``json_schema``           ``response_format`` ``json_schema``
``logprobs``              ``logprobs: true`` (or ``top_logprobs`` above 0)
========================  ==================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from ..wire._messages import InferenceRequest

__all__ = ["ALL_FEATURES", "FEATURES", "Feature", "missing", "needs"]

Feature = Literal["tools", "vision", "json", "json_schema", "logprobs"]
#: Every feature, in the order the docs list them.
FEATURES: Final[tuple[Feature, ...]] = ("tools", "vision", "json", "json_schema", "logprobs")
ALL_FEATURES: Final = frozenset(FEATURES)
_NOTHING: Final[frozenset[str]] = frozenset()


def needs(request: InferenceRequest) -> frozenset[str]:
    """The features ``request`` needs of the backend that serves it."""
    params = request.params
    found: set[str] = set()
    if params.tools:
        found.add("tools")
    if params.logprobs or (params.top_logprobs or 0) > 0:
        found.add("logprobs")
    if params.response_format is not None and params.response_format.type != "text":
        found.add("json" if params.response_format.type == "json_object" else "json_schema")
    for message in request.messages:
        if message.tool_calls or message.role == "tool":
            found.add("tools")
        if not isinstance(message.content, str) and message.images:
            found.add("vision")
    return frozenset(found) if found else _NOTHING


def missing(need: frozenset[str], has: Iterable[str]) -> list[str]:
    """The features of ``need`` that ``has`` lacks, in the docs' order."""
    present = set(has)
    return [feature for feature in FEATURES if feature in need and feature not in present]
