"""The complexity estimator (issue #10 item 3): a request that names no tier
gets one from its route's estimator, recorded with its signals in the
``routed`` event. Pure tables, then end to end on a real nats-server."""

from __future__ import annotations

from typing import Any

import pytest
from test_fallback import FAST, config_for, routed
from test_quota_exhausted import describe, results
from test_restarts import TENANT

from renqueue import Client, Services
from renqueue.broker import EmbeddedServer, EventLog
from renqueue.config import Config, ConfigError, parse_config
from renqueue.mock import MockBackend
from renqueue.policy import estimate_complexity, load_estimator, tier_of
from renqueue.schema import ChatMessage, GenerationParams, InferenceRequest, Routed, Submitted

HARD = (
    "Prove that the sum converges and implement it:\n"
    "$\\sum_{n=1}^{\\infty} \\frac{1}{n^2} = \\pi^2/6$\n"
    "```python\n"
    "def partial(n):\n"
    "    return sum(1 / k**2 for k in range(1, n + 1))\n"
    "```\n"
    "class Series:\n"
    "    pass\n" + "Explain every step in detail. " * 120
)


def request(text: str, **params: Any) -> InferenceRequest:
    return InferenceRequest(
        id="r",
        route="chat",
        messages=[ChatMessage(role="user", content=text)],
        params=GenerationParams(**params),
    )


@pytest.mark.parametrize(
    ("score", "expected"),
    [(0.0, 1), (0.29, 1), (0.3, 2), (0.59, 2), (0.6, 3), (1.0, 3)],
)
def test_a_score_reaches_the_tier_of_the_thresholds_it_passes(score: float, expected: int) -> None:
    assert tier_of(score, [0.3, 0.6], highest=3) == expected


def test_a_tier_is_never_above_the_routes_highest() -> None:
    assert tier_of(1.0, [0.1, 0.2, 0.3], highest=2) == 2


def test_the_heuristic_reads_length_output_code_math_and_depth() -> None:
    easy = estimate_complexity(request("hi"), [0.3, 0.6], highest=3)
    hard = estimate_complexity(request(HARD, max_tokens=2000), [0.3, 0.6], highest=3)
    assert easy.tier == 1
    assert hard.tier == 3
    assert hard.score > easy.score
    assert hard.code_markers >= 3
    assert hard.math_markers >= 2
    assert hard.max_tokens == 2000
    assert hard.prompt_tokens > 800
    # Each signal alone moves the score up.
    base = estimate_complexity(request("plain words"), [0.5], highest=2).score
    longer = estimate_complexity(request("plain words " * 2000), [0.5], highest=2).score
    code = estimate_complexity(request("```\ndef f():\n    return 1\n```"), [0.5], highest=2).score
    assert longer > base
    assert code > base


def test_a_learned_scorer_plugs_in_and_its_signals_are_still_recorded() -> None:
    class Learned:
        name = "routellm-mf"

        def __call__(self, request: InferenceRequest) -> float:
            return 0.95

    got = estimate_complexity(request("hi"), [0.5], highest=2, estimator=Learned())
    assert (got.tier, got.score, got.estimator) == (2, 0.95, "routellm-mf")
    assert got.turns == 1


class AlwaysHard:
    """A stand-in for a scorer a team trained on its own logged outcomes."""

    name = "always-hard"

    def __call__(self, request: InferenceRequest) -> float:
        return 1.0


class Broken:
    name = "broken"

    def __call__(self, request: InferenceRequest) -> float:
        raise RuntimeError("model file missing")


def test_a_scorer_that_fails_or_answers_nonsense_leaves_the_heuristic_to_decide() -> None:
    class NotANumber:
        name = "nan"

        def __call__(self, request: InferenceRequest) -> float:
            return float("nan")

    for scorer, said in ((Broken(), "broken failed: RuntimeError"), (NotANumber(), "nan gave nan")):
        got = estimate_complexity(request("hi"), [0.5], highest=2, estimator=scorer)
        assert got.tier == 1
        assert got.estimator == f"heuristic ({said})"


def test_a_route_names_a_learned_scorer_by_import_path() -> None:
    assert load_estimator("heuristic") is None
    loaded = load_estimator("test_complexity:AlwaysHard")  # a class: made with no arguments
    assert loaded is not None
    assert loaded.name == "always-hard"
    instance = load_estimator("test_complexity:BROKEN")  # an object with a name: as it is
    assert instance is BROKEN
    with pytest.raises(ValueError, match="cannot load estimator"):
        load_estimator("no_such_module_anywhere:scorer")
    with pytest.raises(ValueError, match="cannot load estimator"):
        load_estimator("test_complexity:missing")
    with pytest.raises(TypeError, match="callable with a str 'name'"):
        load_estimator("test_complexity:HARD")
    # Any callable a module exports is not called to see what it makes.
    with pytest.raises(TypeError, match="estimator_factory"):
        load_estimator("builtins:print")
    assert load_estimator("test_complexity:make_always_hard").name == "always-hard"  # type: ignore[union-attr]
    # A module that fails as it loads is a clear error too.
    with pytest.raises(ValueError, match=r"cannot load estimator.*ZeroDivisionError"):
        load_estimator("_broken_estimator:scorer")
    with pytest.raises(ConfigError, match="estimator"):
        parse_config(
            {
                "backends": {"a": {"base_url": "http://127.0.0.1:1", "model": "m"}},
                "routes": {
                    "chat": {
                        "backends": ["a"],
                        "complexity": {"thresholds": [0.5], "estimator": "os; rm -rf /"},
                    }
                },
            }
        )


def test_thresholds_must_ascend() -> None:
    with pytest.raises(ConfigError, match="ascending"):
        parse_config(
            {
                "backends": {"a": {"base_url": "http://127.0.0.1:1", "model": "m"}},
                "routes": {"chat": {"backends": ["a"], "complexity": {"thresholds": [0.6, 0.3]}}},
            }
        )


BROKEN = Broken()


def make_always_hard() -> AlwaysHard:
    return AlwaysHard()


make_always_hard.estimator_factory = True  # type: ignore[attr-defined]


async def test_a_route_with_a_learned_scorer_routes_by_it(isolated_server: EmbeddedServer) -> None:
    """A route whose estimator is ``test_complexity:AlwaysHard`` sends even
    "hi" to the large model; a route naming one that cannot load does not start."""
    async with MockBackend(FAST) as small, MockBackend(FAST) as large:

        def config(estimator: str) -> Config:
            return parse_config(
                {
                    "nats": {"url": isolated_server.url},
                    "backends": {
                        "small": {"base_url": small.url, "model": "m", "tier": 1},
                        "large": {"base_url": large.url, "model": "m", "tier": 2},
                    },
                    "routes": {
                        "chat": {
                            "backends": ["small", "large"],
                            "complexity": {"thresholds": [0.5], "estimator": estimator},
                        }
                    },
                }
            )

        async with (
            Services(config("test_complexity:AlwaysHard")) as services,
            Client(services.nc, tenant=TENANT) as client,
        ):
            log = EventLog(client.js)
            easy = await client.submit("hi", route="chat")
            await results(log, [easy], within=15)
            events = await log.history(TENANT, easy.id)
        with pytest.raises(ConfigError, match=r"\$\.routes\.chat\.complexity\.estimator"):
            async with Services(config("test_complexity:nothing_here")):
                pass
    [decision] = [e for e in events if isinstance(e, Routed)]
    assert decision.backend == "large", describe(events)
    assert decision.complexity_estimate is not None
    assert decision.complexity_estimate.estimator == "always-hard"


async def test_a_hard_request_skips_the_small_model_and_the_estimate_is_in_its_routed_event(
    isolated_server: EmbeddedServer,
) -> None:
    async with MockBackend(FAST) as small, MockBackend(FAST) as large:
        config = config_for(
            isolated_server.url,
            {"small": small, "large": large},
            backends={"small": {"tier": 1}, "large": {"tier": 3}},
        )
        route = config.routes["chat"]
        config = parse_config(
            {
                "nats": {"url": isolated_server.url},
                "backends": {
                    name: {"base_url": b.base_url, "model": "m", "tier": b.tier}
                    for name, b in config.backends.items()
                },
                "routes": {
                    "chat": {
                        "backends": list(route.backends),
                        "complexity": {"thresholds": [0.3, 0.6]},
                    }
                },
                "router": {"capacity_refresh": "20ms"},
            }
        )
        async with Services(config) as services, Client(services.nc, tenant=TENANT) as client:
            log = EventLog(client.js)
            easy = await client.submit("hi", route="chat")
            hard = await client.submit(HARD, route="chat", max_tokens=2000)
            named = await client.submit(HARD, route="chat", complexity=1)
            await results(log, [easy, hard, named], within=15)
            easy_events = await log.history(TENANT, easy.id)
            hard_events = await log.history(TENANT, hard.id)
            named_events = await log.history(TENANT, named.id)
    assert routed(easy_events) == ["small"], describe(easy_events)
    assert routed(hard_events) == ["large"], describe(hard_events)
    [decision] = [e for e in hard_events if isinstance(e, Routed)]
    assert decision.complexity_estimate is not None
    assert decision.complexity_estimate.tier == 3
    assert decision.complexity_estimate.code_markers >= 3
    # The log keeps the client's own word (no complexity) in its submitted event.
    [submitted] = [e for e in hard_events if isinstance(e, Submitted)]
    assert submitted.request.complexity is None
    # A request that names its tier is taken at its word, not estimated.
    [own] = [e for e in named_events if isinstance(e, Routed)]
    assert own.complexity_estimate is None
    assert own.backend == "small"


def test_a_hostile_prompt_is_scanned_in_bounded_time() -> None:
    """Blank lines by the million, braces and dollars: the markers are looked
    for in the first 20,000 characters only, with no quadratic pattern."""
    hostile = "\n" * 1_000_000 + "{ " * 100_000 + "$" * 100_000
    got = estimate_complexity(request(hostile), [0.3, 0.6], highest=3)
    assert got.prompt_tokens > 100_000  # its length still counts whole
    assert got.tier >= 1
