"""The service processes: loops over the broker that carry out the policy's decisions.

- :class:`Router` (``router/``): binds waiting requests to backends (one binder at a time).
- :class:`Worker` (``worker/``): runs dispatched requests against one backend.
- :class:`AdvisoryReader` (``_advisories``): ends requests that ran out of deliveries.
- :class:`Services` (``_service``): the wiring of one process (server, provisioning,
  projector, routers, workers), and :func:`run_until_signalled`.
"""

from ._advisories import AdvisoryReader, MaxDeliveries
from ._service import Services, State, run_until_signalled
from .router import Router
from .worker import Worker

__all__ = [
    "AdvisoryReader",
    "MaxDeliveries",
    "Router",
    "Services",
    "State",
    "Worker",
    "run_until_signalled",
]
