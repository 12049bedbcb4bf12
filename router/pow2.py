"""`PowerOfTwoRequestRouter`: Ray Serve's power-of-two-choices router, the load-only baseline.

Generate calls are ranked by Serve's own ``PowerOfTwoChoicesRequestRouter`` (two random
replicas, the shorter queue); calls aimed at one replica and calls that generate nothing are
routed as under every policy (:mod:`router.call_routing`), and pending calls are fulfilled by
identity, so a replica chosen for a call reaches that call.
"""

from __future__ import annotations

from prefixserve.router.call_routing import ServeRanked
from prefixserve.router.serve_compat import PowerOfTwoChoicesRequestRouter


class PowerOfTwoRequestRouter(ServeRanked, PowerOfTwoChoicesRequestRouter):
    pass
