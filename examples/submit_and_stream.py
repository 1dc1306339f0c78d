"""Submit one request, stream its tokens, print the result.

Run against a running Ren-Queue (`renqueue up` in another terminal):

    python examples/submit_and_stream.py "Write a haiku about queues." chat-small

The NATS URL comes from $RENQUEUE_NATS_URL (default nats://127.0.0.1:4222).
"""

from __future__ import annotations

import asyncio
import os
import sys

from renqueue import Client, RequestFailedError


async def main(prompt: str, route: str) -> int:
    url = os.environ.get("RENQUEUE_NATS_URL", "nats://127.0.0.1:4222")
    async with await Client.connect(url, tenant="examples") as client:
        handle = await client.submit(prompt, route=route, priority="high", timeout=60)
        print(f"request {handle.id}")
        async for chunk in handle.stream(timeout=60):
            if chunk.restart:  # an earlier run was interrupted: start over
                print("\n[restarted]")
            print(chunk.text, end="", flush=True)
        try:
            result = await handle.result(timeout=60)
        except RequestFailedError as exc:
            print(f"\nfailed: {exc} ({exc.error_type})")
            return 1
        usage = result.usage
        print(f"\n-- {result.backend}: {usage.prompt_tokens}+{usage.completion_tokens} tokens,")
        print(f"   ${result.cost:.6f}, {result.duration:.2f}s")
        return 0


if __name__ == "__main__":
    prompt = sys.argv[1] if len(sys.argv) > 1 else "Write a haiku about queues."
    route = sys.argv[2] if len(sys.argv) > 2 else "chat-small"
    sys.exit(asyncio.run(main(prompt, route)))
