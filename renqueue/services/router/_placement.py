"""Where a request goes within its route: its A/B arm and its complexity tier.

A request is placed as it is read (:meth:`Placement.place`): first on its
split's arm (:class:`~renqueue.services.router._splitter.Splitter`), so the
arm's own complexity rules apply, then given the tier its route's estimator
gives it, if it named none (its ``submitted`` event keeps its own word). Each
round, a held request whose split was rolled back or promoted since it was
placed is placed again (:meth:`Placement.follow`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ...config import Config
from ...coordination import LiveState
from ...schema import ComplexityEstimate, InferenceRequest
from ._hold import Held
from ._splitter import Splitter

__all__ = ["Placement"]


class Placement:
    """Places requests on their arm and tier (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._estimators = config.estimators()
        #: A/B splits: each request's arm, and the automatic rollback.
        self.splitter = Splitter(config)

    def place(
        self, request: InferenceRequest, live: LiveState | None
    ) -> tuple[InferenceRequest, ComplexityEstimate | None]:
        """``request`` on its arm, with its tier; the estimate, if one was made."""
        return self._estimated(self.splitter.place(request, live))

    def follow(self, held: Iterable[Held], live: LiveState | None) -> None:
        """Move each held request whose A/B split was rolled back or promoted
        since it was placed to where the split's traffic goes now (its tier
        estimated again, by that arm's rules, if it named none)."""
        if not self.splitter:
            return
        for item in held:
            if not self.splitter.moved(item.request, live):
                continue
            request = item.request
            if item.estimate is not None:
                request = msgspec.structs.replace(request, complexity=None)
            item.request, item.estimate = self.place(request, live)

    def _estimated(
        self, request: InferenceRequest
    ) -> tuple[InferenceRequest, ComplexityEstimate | None]:
        """``request`` with the tier its route's estimator gives it, if the route
        has one and the request named none (its ``submitted`` event keeps its own word)."""
        return self._config.estimated(request, self._estimators)
