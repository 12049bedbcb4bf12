"""The request protocol's error: bad input in a request, refused with an HTTP 400."""


class InvalidRequestError(ValueError):
    """Bad input to the engine (prompt, sampling parameters); the caller maps it to HTTP 400,
    naming `param` (the request field at fault) when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # Ray pickles it back to the ingress: keep the field
        return (type(self), (str(self), self.param))
