"""How hard a request is, when it does not say: the complexity estimator.

A route may ask for one (``[routes.<name>.complexity]``): a request with no
``complexity`` of its own gets a tier from :func:`estimate`, which the binder
then treats as the request's capability floor, and the estimate, with the
signals it was made from, goes into the ``routed`` event for audits.

The default estimator needs no download: a score in ``[0, 1]`` from the
request alone (:func:`heuristic_score`), weighing

- the prompt's length (estimated tokens, saturating at 4000),
- the output it asks for (``max_tokens``, saturating at 2000; unset counts as 0),
- code markers (fenced blocks, ``def``/``class``/``function``/``#include``, braces),
- math markers (LaTeX commands, ``$...$``, equations, sums and integrals),
- conversation depth (turns, saturating at 10),

and the route's ``thresholds`` (ascending) map the score to a tier:
``1 + (thresholds reached)``, never above the route's highest tier. The
interface (:class:`Estimator`) takes a learned scorer instead (a RouteLLM-style
model a team trains on its own logged outcomes): anything that maps a request
to a score in ``[0, 1]``.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Sequence
from typing import Final, Protocol

from ..schema import ComplexityEstimate, InferenceRequest
from ._tokens import estimate_input_tokens

__all__ = ["HEURISTIC", "Estimator", "estimate", "heuristic_score", "load_estimator", "tier_of"]

#: Code: fenced blocks, definitions at the start of a line, lines ending in a brace
#: or a semicolon. Only spaces and tabs are skipped (never newlines: a prompt of
#: blank lines must not make a scan quadratic).
_CODE: Final = re.compile(
    r"```|^[ \t]*(def|class|function|fn|func|public|private|import|#include)\b|[{};][ \t]*$",
    re.MULTILINE,
)
#: Characters of the prompt the markers are looked for in (its length counts whole).
_SCANNED: Final = 20_000
#: Math: LaTeX commands, inline ``$...$`` spans, equations and symbols (counted apart:
#: a command inside a span counts too).
_MATH: Final = (
    re.compile(
        r"\\(frac|sum|int|sqrt|lim|prod|partial|infty|pi|cdot|alpha|beta|theta)(?![A-Za-z])"
    ),
    re.compile(r"\$[^$\n]+\$"),
    re.compile(r"[∑∫√∂π≤≥≠]|[=<>]\s*-?\d"),
)

#: The default estimator's name (``routed.complexity_estimate.estimator``).
HEURISTIC: Final = "heuristic"


class Estimator(Protocol):
    """Scores a request's difficulty in ``[0, 1]`` (1: the hardest)."""

    name: str

    def __call__(self, request: InferenceRequest) -> float: ...


def load_estimator(spec: str) -> Estimator | None:
    """The estimator a route names: ``None`` for :data:`HEURISTIC`, else the
    object ``module.path:name`` names (a scorer the team trained on its own
    logged outcomes): one with a ``name``, as it is; a class, or a function
    marked ``estimator_factory = True``, called with no arguments to make one.
    It runs in the router's read path: it must be quick (a model loaded once,
    scored in microseconds to milliseconds). Raises ``ValueError`` (cannot be
    loaded) or ``TypeError`` (not a scorer) saying why it cannot be used."""
    if spec == HEURISTIC:
        return None
    module_name, _, attribute = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # a module may raise anything as it loads
        raise ValueError(f"cannot load estimator {spec!r}: {type(exc).__name__}: {exc}") from exc
    scorer = found
    if not hasattr(found, "name") or isinstance(found, type):
        # Only a class, or a factory that says it is one, is called to make
        # the scorer: never any callable a module happens to export.
        if not (isinstance(found, type) or getattr(found, "estimator_factory", False)):
            raise TypeError(
                f"estimator {spec!r} must be a callable with a str 'name', a class"
                " making one, or a function marked estimator_factory = True"
            )
        try:
            scorer = found()
        except Exception as exc:
            raise ValueError(
                f"cannot make estimator {spec!r}: {type(exc).__name__}: {exc}"
            ) from exc
    if not callable(scorer) or not isinstance(getattr(scorer, "name", None), str):
        raise TypeError(
            f"estimator {spec!r} must be a callable with a str 'name' (or a factory of one)"
        )
    return scorer  # type: ignore[no-any-return]


def _saturate(value: float, at: float) -> float:
    return min(1.0, max(0.0, value / at))


def signals(request: InferenceRequest) -> ComplexityEstimate:
    """What the heuristic reads of ``request`` (tier and score left at 0)."""
    text = "\n".join(message.text for message in request.messages)[:_SCANNED]
    return ComplexityEstimate(
        tier=0,
        score=0.0,
        estimator=HEURISTIC,
        prompt_tokens=estimate_input_tokens(request),
        max_tokens=request.params.max_tokens or 0,
        code_markers=len(_CODE.findall(text)),
        math_markers=sum(len(pattern.findall(text)) for pattern in _MATH),
        turns=len(request.messages),
    )


def heuristic_score(found: ComplexityEstimate) -> float:
    """The default score of the signals in ``found`` (see the module docstring)."""
    return round(
        0.30 * _saturate(found.prompt_tokens, 4000)
        + 0.20 * _saturate(found.max_tokens, 2000)
        + 0.20 * _saturate(found.code_markers, 3)
        + 0.15 * _saturate(found.math_markers, 3)
        + 0.15 * _saturate(found.turns - 1, 10),
        4,
    )


def tier_of(score: float, thresholds: Sequence[float], *, highest: int) -> int:
    """The tier a score reaches: 1 + thresholds at or below it, at most ``highest``."""
    return max(1, min(highest, 1 + sum(1 for bar in thresholds if score >= bar)))


def estimate(
    request: InferenceRequest,
    thresholds: Sequence[float],
    *,
    highest: int,
    estimator: Estimator | None = None,
) -> ComplexityEstimate:
    """The tier ``request`` needs, with the signals and score it was judged by.

    ``estimator``: a learned scorer instead of :func:`heuristic_score` (the
    signals are recorded all the same). Pure.
    """
    found = signals(request)
    score, name = heuristic_score(found), HEURISTIC
    if estimator is not None:
        try:
            learned = float(estimator(request))
        except Exception as exc:  # noqa: BLE001 - a user's scorer must not stop the router
            name = f"{HEURISTIC} ({estimator.name} failed: {type(exc).__name__})"
        else:
            if math.isfinite(learned):
                score, name = min(1.0, max(0.0, learned)), estimator.name
            else:
                name = f"{HEURISTIC} ({estimator.name} gave {learned})"
    return ComplexityEstimate(
        tier=tier_of(score, thresholds, highest=highest),
        score=score,
        estimator=name,
        prompt_tokens=found.prompt_tokens,
        max_tokens=found.max_tokens,
        code_markers=found.code_markers,
        math_markers=found.math_markers,
        turns=found.turns,
    )
