"""Token estimates that need no tokenizer download: what to reserve before a call.

A quota is reserved when a request is bound, before the provider has counted
anything, and reconciled afterwards with the usage it reports. So the estimate
errs high (text; an image's size is not known before the call, so its count
is a rough figure, :data:`IMAGE_TOKENS`) and costs nothing to compute:

- text: one token per :data:`CHARS_PER_TOKEN` (4) ASCII characters, rounded
  up (the usual rule of thumb for English and code), and one token per
  non-ASCII character (Chinese, Japanese and Korean run at about one token a
  character; other scripts, such as accented Latin or Cyrillic, at fewer, so
  they are overestimated);
- a chat prompt: the text of every message (its text parts, the names and
  arguments of its tool calls), :data:`IMAGE_TOKENS` per image, plus
  :data:`MESSAGE_OVERHEAD_TOKENS` per message (the role and the chat
  template's separators), :data:`REPLY_OVERHEAD_TOKENS` once (the
  assistant turn the reply is primed with), and the tools offered (their
  JSON, which providers put into the prompt);
- a request: its prompt, plus ``max_tokens`` (what the provider may generate
  and, like Cerebras, reserves), or the caller's default when it is unset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from ..schema import ChatMessage, InferenceRequest, Tool

__all__ = [
    "CHARS_PER_TOKEN",
    "IMAGE_TOKENS",
    "MESSAGE_OVERHEAD_TOKENS",
    "REPLY_OVERHEAD_TOKENS",
    "estimate_input_tokens",
    "estimate_prompt_tokens",
    "estimate_request_tokens",
    "estimate_text_tokens",
]

#: ASCII characters per token.
CHARS_PER_TOKEN: Final = 4
#: Tokens each chat message adds beyond its text (role, separators).
MESSAGE_OVERHEAD_TOKENS: Final = 4
#: Tokens a chat prompt adds once (the primed assistant turn).
REPLY_OVERHEAD_TOKENS: Final = 3
#: Tokens an image is counted as: about what Claude counts for a
#: 1.15-megapixel image (its largest before it scales down, ~1,600), above
#: OpenAI's ``high`` detail for 2048 x 2048 (1,105) and Gemini's 258 per
#: 768 x 768 tile for 1536 x 1536 (1,032). Some local vision models count
#: more for large images (Qwen2.5-VL on vLLM up to ~16k): there the estimate
#: is low, as it is for any image whose size is not known before the call.
IMAGE_TOKENS: Final = 1600


#: Output tokens a request without ``max_tokens`` is expected to generate at
#: most (what quota is reserved for, and a cost estimate counts).
DEFAULT_MAX_TOKENS: Final = 1024


def estimate_text_tokens(text: str) -> int:
    """Tokens in ``text``: ASCII characters / 4 rounded up, plus one per other character."""
    ascii_chars = len(text) if text.isascii() else len(text.encode("ascii", "ignore"))
    return -(-ascii_chars // CHARS_PER_TOKEN) + (len(text) - ascii_chars)


def estimate_prompt_tokens(messages: Iterable[ChatMessage], tools: Sequence[Tool] = ()) -> int:
    """Tokens a chat prompt of ``messages`` (offering ``tools``) costs,
    overheads included (0 for no messages)."""
    total = 0
    count = 0
    for message in messages:
        count += 1
        content = message.content
        if isinstance(content, str) and not message.tool_calls:  # the common case, fast
            total += MESSAGE_OVERHEAD_TOKENS + estimate_text_tokens(content)
            continue
        total += MESSAGE_OVERHEAD_TOKENS + estimate_text_tokens(message.text)
        total += IMAGE_TOKENS * len(message.images)
        for call in message.tool_calls:
            total += estimate_text_tokens(call.name) + estimate_text_tokens(call.arguments)
    if tools:
        total += _tools_tokens(tools)
    return total + REPLY_OVERHEAD_TOKENS if count else 0


#: Tools' token counts by the tuple they are (a request keeps its tools'
#: tuple through every copy of it): a planning round estimates each waiting
#: request many times, and encoding a large tool list each time would cost
#: the round milliseconds. Each entry keeps its tuple, so its id is not reused.
_TOOLS_SEEN: dict[int, tuple[Sequence[Tool], int]] = {}
_TOOLS_SEEN_MAX: Final = 4096


def _tools_tokens(tools: Sequence[Tool]) -> int:
    seen = _TOOLS_SEEN.get(id(tools))
    if seen is not None and seen[0] is tools:
        return seen[1]
    count = estimate_text_tokens(msgspec.json.encode(tools).decode())
    if len(_TOOLS_SEEN) >= _TOOLS_SEEN_MAX:
        _TOOLS_SEEN.pop(next(iter(_TOOLS_SEEN)))
    _TOOLS_SEEN[id(tools)] = (tools, count)
    return count


def estimate_input_tokens(request: InferenceRequest) -> int:
    """Tokens ``request``'s prompt costs: its messages and the tools it offers."""
    return estimate_prompt_tokens(request.messages, request.params.tools)


def estimate_request_tokens(request: InferenceRequest, *, default_max_tokens: int) -> int:
    """Tokens to reserve for ``request``: its prompt plus the most it may generate
    (``params.max_tokens``, or ``default_max_tokens`` when unset)."""
    most = request.params.max_tokens
    completion = most if most is not None else max(default_max_tokens, 0)
    return estimate_input_tokens(request) + completion
