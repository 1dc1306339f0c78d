"""The LiteLLM side of ``bench/ratelimits.py``: one burst through ``litellm.Router``.

Run by ``ratelimits.py`` with the Python of the benchmark-only venv that has
``litellm`` (``.renqueue/bench-litellm/venv``), never with the project's: LiteLLM is
not a dependency of Ren-Queue. It imports nothing from ``renqueue`` or ``bench/``.

Reads one JSON object on stdin (the plan ``ratelimits.py`` writes: the mocks'
URLs, each backend's ``rpm``/``tpm`` as LiteLLM is to be told them, prices, the
fallback order and the burst itself: prompt and ``max_tokens`` per request), sends
every request of the burst at once through one ``Router`` with
``routing_strategy="usage-based-routing-v2"`` and ``fallbacks`` in the cascade order,
and prints one JSON object on stdout: per request, who served it (the mock echoes
the model name it was asked for), its usage, LiteLLM's own cost figure, its latency
or the error it ended with; and the router's settings as LiteLLM reports them.

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
        "model_list": [
            {
                "model_name": entry["model_name"],
                "litellm_params": {
                    k: v for k, v in entry["litellm_params"].items() if k != "api_key"
                },
            }
            for entry in model_list(plan)
        ],
        "fallbacks": [{order[0]: order[1:]}],
        "began": began,
        "ended": ended,
        "cpu_s": cpu,
        "rows": rows,
    }


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


def main() -> None:
    plan = json.load(sys.stdin)
    litellm.suppress_debug_info = True
    litellm.telemetry = False
    logging.getLogger("LiteLLM").setLevel(logging.ERROR)
    logging.getLogger("LiteLLM Router").setLevel(logging.ERROR)
    logging.getLogger("LiteLLM Proxy").setLevel(logging.ERROR)
    report = asyncio.run(burst(plan))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
