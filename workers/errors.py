"""Errors the engine raises on purpose, so callers can map them to the right response.

`InvalidRequestError` is the request protocol's (router/errors.py): the ingress and the
engine's own checks raise the same one."""

from prefixserve.router.errors import InvalidRequestError

__all__ = ["InvalidRequestError", "StepFailedError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or features this engine does not implement."""


class StepFailedError(RuntimeError):
    """A step raised (its forward pass, usually); the requests it ran were dropped.

    The requests in ``request_ids`` are gone from the engine, their blocks freed, and no block
    the step was writing stays cached; every other request goes on. Callers fail exactly these.
    """

    def __init__(self, request_ids: tuple[str, ...]) -> None:
        super().__init__(f"engine step failed; dropped {len(request_ids)} request(s)")
        self.request_ids = request_ids
