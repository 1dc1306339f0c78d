"""The LiteLLM side of ``bench/ratelimits.py``, ``bench/faults.py``, ``bench/economics.py``
and ``bench/pipeline.py --procs``, through ``litellm.Router``.

Run by those benchmarks with the Python of the benchmark-only venv that has
``litellm`` (``.renqueue/bench-litellm/venv``), never with the project's: LiteLLM is
not a dependency of Ren-Queue. It imports nothing from ``renqueue`` or ``bench/``.

Reads one JSON object on stdin (the plan the benchmark writes: the mocks' URLs, each
backend's ``rpm``/``tpm``/``max_parallel_requests`` as LiteLLM is to be told them,
prices, the fallback order, the Router's other keyword arguments and the requests:
prompt and ``max_tokens`` each). In every mode the Router is built first, ``ready`` is
printed on a line of its own, and the workload starts when a line comes back on stdin
(so the benchmark's clock and schedule start with the workload, not with LiteLLM's
imports). Its ``mode`` says what to do with the requests:

- ``burst`` (``ratelimits.py``, the default): every request at once, not streamed,
  through one ``Router`` with ``routing_strategy="usage-based-routing-v2"`` and
  ``fallbacks`` in the cascade order.
- ``open-loop`` (``faults.py``): request ``i`` is sent at its ``at`` seconds from the
  start, streamed (``stream=True``), and must end within ``deadline`` seconds of being
  sent (else it counts as expired). The default routing strategy (``simple-shuffle``:
  one deployment per group, so no choice).
- ``closed-loop`` (``pipeline.py --procs``): at each of the plan's ``levels`` (C), C
  tasks each repeat one call (``prompt``, ``max_tokens``, not streamed) to the first
  backend's model group for ``warmup_s`` seconds, then for ``seconds`` seconds counted:
  per level the completions, their latencies, the errors and the CPU seconds this
  process used in the counted window (``time.process_time``). No per-request rows.
- ``trace`` (``economics.py``): as ``open-loop`` (each request at its ``at``), not
  streamed, but each request says its own cascade (``models``: the first is the model
  group asked for, the rest its ``fallbacks``), its ``priority`` (an integer, lower
  first: LiteLLM's priority scheduler), its ``deadline`` (also the call's ``timeout``)
  and its ``messages``; the Router's ``routing_strategy`` comes with its other keyword
  arguments. Before ``ready``, the ``warmup`` calls (``model``, ``messages``,
  ``max_tokens`` each) are made straight to their model group, a few at a time per group
  (its ``max_parallel_requests``), so a router that learns from its calls starts with
  some.

It prints one JSON object on stdout: per request, who served it (the mock echoes the
model name it was asked for), its usage, LiteLLM's own cost figure, its latency or the
error it ended with (open-loop: also the time of its first token, its text, and the
retries and fallbacks LiteLLM says it made, from ``x-litellm-attempted-retries`` and
``x-litellm-attempted-fallbacks``; trace: the fallbacks); and the router's settings as
LiteLLM reports them.

Nothing here holds a secret: the mocks need no key, so the key passed is a dummy
(LiteLLM's OpenAI client refuses to start without one), and it is never printed.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import sys
import time
from typing import Any

import litellm
from litellm import Router
from litellm.integrations.custom_logger import CustomLogger

#: Not a secret: the mocks accept any key, and LiteLLM's OpenAI client wants one.
DUMMY_KEY = "sk-bench-no-key"


def model_list(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """One model group per backend (its name is the group), one deployment each, with
    the limits and prices the plan gives LiteLLM."""
    out = []
    for backend in plan["backends"]:
        params: dict[str, Any] = {
            "model": f"openai/{backend['name']}",
            "api_base": backend["url"],
            "api_key": DUMMY_KEY,
            # Custom pricing (dollars per token), so LiteLLM's own cost figure is comparable.
            "input_cost_per_token": backend["price_in_per_mtok"] / 1e6,
            "output_cost_per_token": backend["price_out_per_mtok"] / 1e6,
        }
        if backend.get("rpm"):
            params["rpm"] = backend["rpm"]
        if backend.get("tpm"):
            params["tpm"] = backend["tpm"]
        if backend.get("max_parallel_requests"):
            params["max_parallel_requests"] = backend["max_parallel_requests"]
        out.append({"model_name": backend["name"], "litellm_params": params})
    return out


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace(DUMMY_KEY, "<key>")
    return " ".join(text.split())[:300]


async def burst(plan: dict[str, Any]) -> dict[str, Any]:
    order: list[str] = plan["fallback_order"]
    router = Router(
        model_list=model_list(plan),
        routing_strategy="usage-based-routing-v2",
        fallbacks=[{order[0]: order[1:]}],
        timeout=plan["timeout_s"],
        **plan.get("router_kwargs", {}),
    )
    settings = _settings(router)
    await _ready()

    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
        start = time.time()
        row: dict[str, Any] = {"index": index, "submitted_at": start}
        try:
            response = await router.acompletion(
                model=order[0],
                messages=[{"role": "user", "content": item["prompt"]}],
                max_tokens=item["max_tokens"],
            )
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
            row.update(outcome="failed", error=_error_text(exc), ended_at=time.time())
            return row
        usage = getattr(response, "usage", None)
        hidden = getattr(response, "_hidden_params", {}) or {}
        row.update(
            outcome="completed",
            ended_at=time.time(),
            # The mock echoes the model it was asked for: the backend's name.
            backend=str(response.model).removeprefix("openai/"),
            prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            completion_tokens=getattr(usage, "completion_tokens", 0) or 0,
            litellm_cost=hidden.get("response_cost"),
            text_chars=len(response.choices[0].message.content or ""),
        )
        return row

    cpu = time.process_time()
    began = time.time()
    rows = await asyncio.gather(*(one(i, item) for i, item in enumerate(plan["burst"])))
    ended = time.time()
    cpu = time.process_time() - cpu
    return {
        "litellm_version": _version(),
        "router_settings": settings,
        "model_list": _shown(plan),
        "fallbacks": [{order[0]: order[1:]}],
        "began": began,
        "ended": ended,
        "cpu_s": cpu,
        "rows": rows,
    }


async def _ready() -> None:
    """Say ``ready`` (the Router is built) and wait for the word to start (a line on stdin),
    so the benchmark's clock and schedule start with the workload, not with LiteLLM's
    imports and set-up."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.readline)


def _settings(router: Router) -> dict[str, Any]:
    """What the router says of the settings that decide retries, cooldowns and routing."""
    try:
        view = router.settings()
    except Exception as exc:  # noqa: BLE001 - an older LiteLLM: reported, not needed
        return {"unavailable": _error_text(exc)}
    names = ("routing_strategy", "allowed_fails", "cooldown_time", "disable_cooldowns")
    return {name: _plain(getattr(view, name, None)) for name in names}


def _plain(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return repr(value)
    return value


def _version() -> str:
    try:
        return importlib.metadata.version("litellm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class FailedCalls(CustomLogger):
    """Every upstream call that failed, by request (the ``[index]`` its prompt starts with):
    LiteLLM logs a failure per call it made, a stream broken after tokens included, and none
    for a deployment it did not call (at its ``max_parallel_requests``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_index: dict[int, list[str]] = {}

    async def async_log_failure_event(
        self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        messages = kwargs.get("messages") or [{}]
        prompt = str(messages[0].get("content", ""))
        if not prompt.startswith("["):
            return
        index = int(prompt[1 : prompt.index("]")])
        model = str(kwargs.get("model") or "").removeprefix("openai/")
        exc = kwargs.get("exception")
        self.by_index.setdefault(index, []).append(f"{model} {type(exc).__name__}")


async def open_loop(plan: dict[str, Any]) -> dict[str, Any]:
    """Each request at its time, streamed, within its deadline (see the module docstring)."""
    order: list[str] = plan["fallback_order"]
    failed_calls = FailedCalls()
    litellm.callbacks = [failed_calls]
    fallbacks = [{order[0]: order[1:]}]
    router = Router(
        model_list=model_list(plan),
        fallbacks=fallbacks,
        timeout=plan["timeout_s"],
        **plan.get("router_kwargs", {}),
    )
    settings = _settings(router)
    await _ready()
    t0 = time.time()
    deadline: float = plan["deadline"]

    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + item["at"] - time.time()))
        start = time.time()
        row: dict[str, Any] = {"index": index, "submitted_at": start}
        seen: dict[str, Any] = {"parts": [], "first": None, "model": None, "finish": None}
        response: Any = None

        async def call() -> None:
            nonlocal response
            response = await router.acompletion(
                model=order[0],
                messages=[{"role": "user", "content": item["prompt"]}],
                max_tokens=item["max_tokens"],
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in response:
                if getattr(chunk, "model", None):
                    seen["model"] = chunk.model
                for choice in getattr(chunk, "choices", None) or ():
                    text = getattr(choice.delta, "content", None)
                    if text:
                        seen["first"] = seen["first"] or time.time()
                        seen["parts"].append(text)
                    if getattr(choice, "finish_reason", None):
                        seen["finish"] = choice.finish_reason

        try:
            await asyncio.wait_for(call(), timeout=deadline)
        except TimeoutError:
            row.update(outcome="expired", error="deadline passed", ended_at=time.time())
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
            row.update(outcome="failed", error=_error_text(exc), ended_at=time.time())
        else:
            row.update(outcome="completed", ended_at=time.time())
        headers = (getattr(response, "_hidden_params", None) or {}).get("additional_headers") or {}
        row.update(
            first_token_at=seen["first"],
            # The mock echoes the model it was asked for: the backend's name.
            backend=str(seen["model"] or "").removeprefix("openai/") or None,
            finish_reason=seen["finish"],
            text="".join(seen["parts"]),
            attempted_retries=headers.get("x-litellm-attempted-retries"),
            attempted_fallbacks=headers.get("x-litellm-attempted-fallbacks"),
        )
        return row

    cpu = time.process_time()
    rows = await asyncio.gather(*(one(i, item) for i, item in enumerate(plan["requests"])))
    cpu = time.process_time() - cpu
    ended = time.time()
    await asyncio.sleep(1.0)  # failure callbacks run in tasks of their own
    for row in rows:
        row["failed_calls"] = failed_calls.by_index.get(row["index"], [])
    return {
        "litellm_version": _version(),
        "router_settings": settings,
        "model_list": _shown(plan),
        "fallbacks": fallbacks,
        "began": t0,
        "ended": ended,
        "cpu_s": cpu,
        "rows": rows,
    }


async def trace(plan: dict[str, Any]) -> dict[str, Any]:
    """Each request at its time, on its own cascade, at its priority, within its deadline
    (see the module docstring)."""
    router = Router(
        model_list=model_list(plan), timeout=plan["timeout_s"], **plan.get("router_kwargs", {})
    )
    settings = _settings(router)
    warmed = await _warm_up(router, plan)
    await _ready()
    t0 = time.time()

    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + item["at"] - time.time()))
        start = time.time()
        row: dict[str, Any] = {"index": index, "submitted_at": start}
        first, *rest = item["models"]
        deadline: float = item["deadline"]
        try:
            response: Any = await asyncio.wait_for(
                router.acompletion(
                    model=first,
                    messages=item["messages"],
                    max_tokens=item["max_tokens"],
                    fallbacks=[{first: rest}] if rest else [],
                    priority=item["priority"],
                    timeout=deadline,
                ),
                timeout=deadline,
            )
        except TimeoutError:
            row.update(outcome="expired", error="deadline passed", ended_at=time.time())
            return row
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the report
            row.update(outcome="failed", error=_error_text(exc), ended_at=time.time())
            return row
        usage = getattr(response, "usage", None)
        hidden = getattr(response, "_hidden_params", {}) or {}
        headers = hidden.get("additional_headers") or {}
        row.update(
            outcome="completed",
            ended_at=time.time(),
            # The mock echoes the model it was asked for: the backend's name.
            backend=str(response.model).removeprefix("openai/"),
            prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
            completion_tokens=getattr(usage, "completion_tokens", 0) or 0,
            litellm_cost=hidden.get("response_cost"),
            attempted_fallbacks=headers.get("x-litellm-attempted-fallbacks"),
            prioritized=bool(headers.get("x-litellm-request-prioritization-used")),
        )
        return row

    cpu = time.process_time()
    rows = await asyncio.gather(*(one(i, item) for i, item in enumerate(plan["requests"])))
    cpu = time.process_time() - cpu
    return {
        "litellm_version": _version(),
        "router_settings": settings,
        "model_list": _shown(plan),
        "began": t0,
        "ended": time.time(),
        "cpu_s": cpu,
        "warmup": warmed,
        "rows": rows,
    }


async def _warm_up(router: Router, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's ``warmup`` calls, straight to their model group: how many completed and
    the errors of the others, per group."""
    slots = {b["name"]: b.get("max_parallel_requests") or 1 for b in plan["backends"]}
    gates = {name: asyncio.Semaphore(n) for name, n in slots.items()}
    done: dict[str, list[str]] = {name: [] for name in slots}

    async def one(item: dict[str, Any]) -> None:
        async with gates[item["model"]]:
            try:
                await router.acompletion(
                    model=item["model"], messages=item["messages"], max_tokens=item["max_tokens"]
                )
            except Exception as exc:  # noqa: BLE001 - reported with the warm-up
                done[item["model"]].append(_error_text(exc))
            else:
                done[item["model"]].append("ok")

    await asyncio.gather(*(one(item) for item in plan.get("warmup", [])))
    return {
        name: {"ok": results.count("ok"), "errors": [r for r in results if r != "ok"][:3]}
        for name, results in done.items()
        if results
    }


async def closed_loop(plan: dict[str, Any]) -> dict[str, Any]:
    """C tasks each repeating one whole call, at each level (see the module docstring)."""
    group = plan["backends"][0]["name"]
    router = Router(
        model_list=model_list(plan), timeout=plan["timeout_s"], **plan.get("router_kwargs", {})
    )
    settings = _settings(router)
    await _ready()
    messages = [{"role": "user", "content": plan["prompt"]}]

    async def window(level: int, seconds: float) -> dict[str, Any]:
        latencies: list[float] = []
        errors: list[str] = []
        end = time.perf_counter() + seconds
        began = time.perf_counter()
        last = began

        async def one() -> None:
            nonlocal last
            while time.perf_counter() < end:
                start = time.perf_counter()
                try:
                    await router.acompletion(
                        model=group, messages=messages, max_tokens=plan["max_tokens"]
                    )
                except Exception as exc:  # noqa: BLE001 - counted, the run goes on
                    errors.append(_error_text(exc))
                    await asyncio.sleep(0.01)
                    continue
                last = time.perf_counter()
                latencies.append(last - start)

        cpu = time.process_time()
        await asyncio.gather(*(one() for _ in range(level)))
        return {
            "concurrency": level,
            "seconds": last - began,
            "cpu_s": time.process_time() - cpu,
            "latencies": latencies,
            "errors": len(errors),
            "error_samples": errors[:3],
        }

    levels = []
    for level in plan["levels"]:
        await window(level, plan["warmup_s"])
        levels.append(await window(level, plan["seconds"]))
    return {"litellm_version": _version(), "router_settings": settings, "levels": levels}


def _shown(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The model list as given to the Router, without the (dummy) key."""
    return [
        {
            "model_name": entry["model_name"],
            "litellm_params": {k: v for k, v in entry["litellm_params"].items() if k != "api_key"},
        }
        for entry in model_list(plan)
    ]


def main() -> None:
    plan = json.loads(sys.stdin.readline())
    litellm.suppress_debug_info = True
    litellm.telemetry = False
    logging.getLogger("LiteLLM").setLevel(logging.ERROR)
    logging.getLogger("LiteLLM Router").setLevel(logging.ERROR)
    logging.getLogger("LiteLLM Proxy").setLevel(logging.ERROR)
    modes = {
        "burst": burst,
        "open-loop": open_loop,
        "trace": trace,
        "closed-loop": closed_loop,
    }
    report = asyncio.run(modes[plan.get("mode", "burst")](plan))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
