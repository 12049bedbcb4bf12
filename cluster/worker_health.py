"""The ingress's view of its workers' health: stalled workers marked in the router's watch and
probed until they answer, and readiness (every worker answers).

A generation whose worker missed its progress deadline reports the replica here. The process's
:data:`router.worker_watch.WATCH` then keeps every routing policy off it, and one probe per
replica (a ``stats`` call aimed at it, every ``interval_s``) waits for its answer. Any answer
clears the mark, as does word that the replica is gone (Serve replaced it); only silence keeps
it.

The ingress reaches the watch only through this object: Serve pickles the ingress class by
value, and a module global its methods named would be a copy, not the router's.
"""

from __future__ import annotations

import asyncio
import logging

from ray.serve.handle import DeploymentHandle

from prefixserve.router.worker_watch import WATCH, WorkerWatch

logger = logging.getLogger("ray.serve")


class WorkerHealth:
    """Marks stalled workers, probes each until it answers, and says whether all can serve."""

    def __init__(self, workers: DeploymentHandle, interval_s: float,
                 watch: WorkerWatch = WATCH) -> None:
        self.workers = workers
        self.interval_s = interval_s
        self.watch = watch
        self._probes: dict[str, asyncio.Task] = {}

    def stalled(self, replica: str) -> None:
        """`replica` missed a progress deadline: routed around until it answers a probe."""
        if self.watch.stall(replica):
            logger.warning("worker %s stalled: routing around it until it answers", replica)
        if replica not in self._probes:
            self._probes[replica] = asyncio.get_running_loop().create_task(self._probe(replica))

    async def readiness(self, timeout_s: float) -> dict[str, str]:
        """Each worker Serve routes to: "ready" (answered a stats call within `timeout_s`, its
        engine loop included), "silent", or "stalled" (missed a progress deadline, not asked)."""
        if not self.watch.running():  # the handle's router starts on its first call
            await self._answers(None, timeout_s)
        running, stalled = self.watch.running(), self.watch.stalled()
        asked = sorted(running - stalled)
        answers = await asyncio.gather(*(self._answers(r, timeout_s) for r in asked))
        states = dict.fromkeys(sorted(stalled & running), "stalled")
        states |= {r: "ready" if ok else "silent" for r, ok in zip(asked, answers, strict=True)}
        return states

    async def _answers(self, replica: str | None, timeout_s: float) -> bool:
        """Whether `replica` (None: any worker) answers a stats call within `timeout_s`."""
        call = self.workers.stats.remote(target_worker=replica)
        try:
            await asyncio.wait_for(call, timeout_s)
        except Exception:
            call.cancel()
            return False
        return True

    async def _probe(self, replica: str) -> None:
        try:
            while replica in self.watch.running():  # else Serve replaced it: nothing to wait for
                call = self.workers.stats.remote(target_worker=replica)
                try:
                    await asyncio.wait_for(call, self.interval_s)
                except asyncio.TimeoutError:
                    call.cancel()
                    continue
                except Exception as exc:  # an answer all the same (or the replica is gone)
                    logger.info("probe of worker %s: %r", replica, exc)
                logger.warning("worker %s answers again", replica)
                break
        finally:
            self.watch.answered(replica)
            self._probes.pop(replica, None)
