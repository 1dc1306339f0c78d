"""The protocol every backend adapter implements.

An adapter turns an :class:`~renqueue.schema.InferenceRequest` into a call to
one endpoint + model + credentials, and the response into :class:`Delta` pieces
(streaming) or one :class:`Generation`. Every failure leaves an adapter as a
:class:`~renqueue.errors.BackendError` subclass: rate-limited (with
``retry_after``), retryable, fatal, or bad request. Nothing else escapes
(``asyncio.CancelledError`` excepted: cancellation is not failure).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final, Protocol, runtime_checkable

from msgspec import Struct

from ..schema import InferenceRequest, TokenLogprob, ToolCall, Usage

__all__ = ["FINISH_REASONS", "Backend", "Delta", "Generation", "ToolCall"]

#: The finish reasons adapters map their provider's onto (OpenAI's names):
#: ``stop`` (the model ended, or a stop sequence), ``length`` (the token
#: limit), ``tool_calls`` (it asked for tools), ``content_filter`` (a
#: provider's filter cut or refused the answer). A provider reason with no
#: counterpart passes through in lower case (Gemini's ``other``, ...).
FINISH_REASONS: Final = ("stop", "length", "tool_calls", "content_filter")


class Delta(Struct, frozen=True, kw_only=True):
    """A piece of a streamed answer. The last one carries usage, finish reason
    and the tool calls the model asked for."""

    text: str = ""
    usage: Usage | None = None
    finish_reason: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    #: The log probabilities of this piece's tokens (a request that asked for them).
    logprobs: tuple[TokenLogprob, ...] = ()
    #: The stream's end came with this piece (in the same network read, or
    #: this is the last delta): no text follows it, so a consumer may send it
    #: with the answer's end instead of on its own. Only a hint: ``False``
    #: is always correct, and the stream still ends when the iterator does.
    end: bool = False


class Generation(Struct, frozen=True, kw_only=True):
    """A whole answer."""

    text: str
    usage: Usage
    finish_reason: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@runtime_checkable
class Backend(Protocol):
    """One callable backend. Safe to share between concurrent calls."""

    @property
    def name(self) -> str: ...

    def stream(
        self,
        request: InferenceRequest,
        *,
        priority: int | None = None,
        traceparent: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Yield the answer as it is generated. Closing the iterator aborts the call.

        ``traceparent``: the W3C trace context of the call (the caller's span
        for it), sent on as the ``traceparent`` header if it is a valid one.
        """
        ...

    async def complete(
        self,
        request: InferenceRequest,
        *,
        priority: int | None = None,
        traceparent: str | None = None,
    ) -> Generation:
        """The whole answer in one response (``traceparent`` as for :meth:`stream`)."""
        ...

    async def close(self) -> None:
        """Release connections. Idempotent."""
        ...
