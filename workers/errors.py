"""Errors the engine raises on purpose, so callers can map them to the right response."""


class InvalidRequestError(ValueError):
    """Bad input to the engine (prompt, sampling parameters); the caller maps it to HTTP 400."""


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or features this engine does not implement."""
