"""``renqueue up`` with the gateway: the services, then the gateway in front of them.

Started last (once routers and workers run, nothing it submits waits on a
service still starting) and stopped first (it stops taking requests before
the routers stop routing them), on a connection of its own and under the
services' supervisor: a gateway job that cannot go on stops the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .config import Config
from .gateway import Gateway
from .services import Services

if TYPE_CHECKING:
    from .coordination import ClusterMetrics

__all__ = ["ServicesWithGateway"]


class ServicesWithGateway(Services):
    """:class:`~renqueue.services.Services` plus the gateway (``[gateway]``)."""

    def __init__(
        self,
        config: Config,
        *,
        routers: int = 1,
        backends: Sequence[str] | None = None,
        port: int | None = None,
        cluster_metrics: ClusterMetrics | None = None,
    ) -> None:
        super().__init__(
            config, routers=routers, backends=backends, cluster_metrics=cluster_metrics
        )
        self._gateway_port = port
        self.gateway: Gateway | None = None

    async def _start(self) -> None:
        await super()._start()
        self.gateway = Gateway(
            self.config,
            url=self.url,
            supervisor=self.supervisor,
            port=self._gateway_port,
            name=f"{self._name}-gateway",
        )
        await self.gateway.start()

    async def _close(self) -> None:
        try:
            if self.gateway is not None:
                await self.gateway.close()
        finally:
            await super()._close()
