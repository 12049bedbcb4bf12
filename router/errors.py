"""The request protocol's error: bad input in a request, refused with an HTTP 400."""


class InvalidRequestError(ValueError):
    """Bad input to the engine (prompt, sampling parameters); the caller maps it to HTTP 400."""
