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
                          (a ``tool`` turn with a ``tool_call_id``; one
                          without, as version 1 wrote them, is plain text)
``vision``                image content parts
``image_urls``            image parts by ``https://`` URL (not ``data:``): the
                          backend fetches them, from wherever it runs
``json``                  ``response_format`` ``json_object``
``json_schema``           ``response_format`` ``json_schema``
``logprobs``              ``logprobs: true`` (or ``top_logprobs`` above 0)
========================  ==================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from ..schema import InferenceRequest

__all__ = ["ALL_FEATURES", "FEATURES", "Feature", "missing", "needs"]

Feature = Literal["tools", "vision", "image_urls", "json", "json_schema", "logprobs"]
#: Every feature, in the order the docs list them.
FEATURES: Final[tuple[Feature, ...]] = (
    "tools",
    "vision",
    "image_urls",
    "json",
    "json_schema",
    "logprobs",
)
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
        if message.tool_calls or message.tool_call_id is not None:
            found.add("tools")
        if not isinstance(message.content, str):
            images = message.images
            if images:
                found.add("vision")
            if any(not image.url.startswith("data:") for image in images):
                found.add("image_urls")
    return frozenset(found) if found else _NOTHING


def missing(need: frozenset[str], has: Iterable[str]) -> list[str]:
    """The features of ``need`` that ``has`` lacks, in the docs' order."""
    present = set(has)
    return [feature for feature in FEATURES if feature in need and feature not in present]
