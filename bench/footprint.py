"""What one request leaves in each stream and bucket: the per-request footprint
the storage sizing rule of docs/operations.md#storage is written from.

Runs ``--requests`` chat requests (a short prompt, ``--output-tokens`` streamed
tokens from the mock backend at ``--tokens-per-second``) through the embedded
server and the services, in one process, waits for every one to end, and
prints each store's bytes per request (its growth over the run, divided by the
requests): the work queues (``RQ_REQUESTS``, ``RQ_DISPATCH``) are empty again by
then, the event log, the tokens and the terminal claims keep what each request
left. Writes
``bench/results/footprint-latest.json``.

    .venv/bin/python bench/footprint.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from common import RESULTS, git_commit

from renqueue import Client, Services, parse_config
from renqueue.broker import STORES
from renqueue.mock import MockBackend, MockSettings

PROMPT = "Summarise the plot of a short story about a lighthouse keeper in two lines."


async def run(
    requests: int, output_tokens: int, speed: float, concurrency: int
) -> dict[str, object]:
    settings = MockSettings(ttft=0.0, tokens_per_second=speed, output_tokens=output_tokens)
    with tempfile.TemporaryDirectory() as data:
        async with MockBackend(settings) as mock:
            config = parse_config(
                {
                    "nats": {"data_dir": str(Path(data) / "nats"), "port": -1},
                    "backends": {
                        "b": {"base_url": mock.url, "model": "m", "limits": {"concurrency": 64}}
                    },
                    "routes": {"chat": {"backends": ["b"]}},
                }
            )
            async with Services(config) as services, Client(services.nc, tenant="t") as client:
                js = client.js

                async def sizes() -> dict[str, int]:
                    infos = await asyncio.gather(*(js.stream_info(name) for name in STORES))
                    return {
                        name: int(info.state.bytes or 0)
                        for name, info in zip(STORES, infos, strict=True)
                    }

                before = await sizes()
                gate = asyncio.Semaphore(concurrency)

                async def one(index: int) -> None:
                    async with gate:
                        handle = await client.submit(PROMPT, route="chat", request_id=f"f-{index}")
                        await handle.result(timeout=120)

                began = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(requests)))
                took = time.perf_counter() - began
                after = await sizes()
    per_request = {name: (after[name] - before[name]) / requests for name in STORES}
    return {
        "commit": git_commit(),
        "requests": requests,
        "output_tokens": output_tokens,
        "tokens_per_second": speed,
        "seconds": round(took, 1),
        "bytes_per_request": {name: round(value, 1) for name, value in per_request.items()},
        "total_per_request": round(sum(per_request.values()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=100.0,
        help="the mock's speed: slower streams send more, smaller chunks (0: all at once)",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    result = asyncio.run(
        run(args.requests, args.output_tokens, args.tokens_per_second, args.concurrency)
    )
    print(
        f"{args.requests} requests, {args.output_tokens} output tokens each"
        f" at {args.tokens_per_second:g} tokens/s:"
    )
    per_request = result["bytes_per_request"]
    assert isinstance(per_request, dict)
    for name, value in per_request.items():
        print(f"  {name:<16} {value:>9.1f} B/request")
    print(f"  {'all':<16} {result['total_per_request']:>9.1f} B/request")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "footprint-latest.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
