"""A backend's speed and reliability, learned from its own calls in the log.

:class:`Perf` holds time to first token, output tokens per second after it,
and output length, each as a moving average with its spread (exponentially
weighted variance, the newest call weighing :data:`WEIGHT`), and how often a
call fails for the backend's own fault or a 429. The projection folds it
(:func:`learn_call` on a completion, :func:`learn_fault` on a failure); the
planner predicts with it (:func:`renqueue.policy.predict`).
"""

from __future__ import annotations

import math
from typing import Annotated, Final

from msgspec import Meta, Struct

NonNegative = Annotated[float, Meta(ge=0)]
Probability = Annotated[float, Meta(ge=0, le=1)]

#: Weight of the newest sample in every moving average and variance.
WEIGHT: Final = 0.2
#: Completions a backend needs before its model is used.
MIN_SAMPLES: Final = 5
#: Seconds of generation below which a call's token rate is not timed (a
#: clock's resolution would make it any number).
_MIN_TIMED: Final = 1e-3


class Perf(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A backend's speed and reliability, learned from its calls in the log.

    Times in seconds, rates in output tokens per second after the first
    token. ``*_var`` are exponentially weighted variances. ``fault_p`` and
    ``limited_p`` are moving averages of "this call failed for the backend's
    fault" and "this call got a 429" over every call that ended.
    """

    # Bounded so that a damaged or forged view fails to decode (and is
    # logged and ignored) rather than reaching a prediction.
    samples: Annotated[int, Meta(ge=0)] = 0
    ttft: NonNegative = 0.0
    ttft_var: NonNegative = 0.0
    rate: NonNegative = 0.0
    rate_var: NonNegative = 0.0
    #: Output tokens of a completed call.
    output: NonNegative = 0.0
    output_var: NonNegative = 0.0
    fault_p: Probability = 0.0
    limited_p: Probability = 0.0

    @property
    def ttft_sd(self) -> float:
        return math.sqrt(max(0.0, self.ttft_var))

    @property
    def rate_sd(self) -> float:
        return math.sqrt(max(0.0, self.rate_var))

    @property
    def output_sd(self) -> float:
        return math.sqrt(max(0.0, self.output_var))


def _moved(mean: float, var: float, sample: float, first: bool) -> tuple[float, float]:
    """An exponentially weighted mean and variance after ``sample``."""
    if first:
        return sample, 0.0
    diff = sample - mean
    increment = WEIGHT * diff
    return mean + increment, (1 - WEIGHT) * (var + diff * increment)


def learn_call(
    perf: Perf | None, *, ttft: float | None, duration: float, output_tokens: int
) -> Perf:
    """``perf`` after a completed call: its time to first token, total duration
    and output tokens. A call with no first token time (not streamed) or too
    short to time its tokens teaches the output length only; non-finite or
    negative times teach nothing of speed."""
    perf = perf or Perf()
    first = perf.samples == 0
    output, output_var = _moved(perf.output, perf.output_var, float(max(0, output_tokens)), first)
    ttft_mean, ttft_var, rate, rate_var = perf.ttft, perf.ttft_var, perf.rate, perf.rate_var
    timed = (
        ttft is not None
        and math.isfinite(ttft)
        and math.isfinite(duration)
        and 0 <= ttft <= duration
    )
    if timed and ttft is not None:
        ttft_mean, ttft_var = _moved(perf.ttft, perf.ttft_var, ttft, first)
        generating = duration - ttft
        if output_tokens > 1 and generating >= _MIN_TIMED:
            sample = (output_tokens - 1) / generating
            rate, rate_var = _moved(perf.rate, perf.rate_var, sample, perf.rate <= 0)
    return Perf(
        samples=perf.samples + 1,
        ttft=ttft_mean,
        ttft_var=ttft_var,
        rate=rate,
        rate_var=rate_var,
        output=output,
        output_var=output_var,
        fault_p=(1 - WEIGHT) * perf.fault_p,
        limited_p=(1 - WEIGHT) * perf.limited_p,
    )


def learn_fault(perf: Perf | None, *, fault: bool, rate_limited: bool) -> Perf:
    """``perf`` after a failed call: a fault of the backend's, a 429, or neither
    (a bad request, a context too long: the request's own doing)."""
    perf = perf or Perf()
    return Perf(
        samples=perf.samples,
        ttft=perf.ttft,
        ttft_var=perf.ttft_var,
        rate=perf.rate,
        rate_var=perf.rate_var,
        output=perf.output,
        output_var=perf.output_var,
        fault_p=(1 - WEIGHT) * perf.fault_p + (WEIGHT if fault else 0.0),
        limited_p=(1 - WEIGHT) * perf.limited_p + (WEIGHT if rate_limited else 0.0),
    )
