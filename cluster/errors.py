"""`ApiError`: an HTTP error in OpenAI's envelope, shared by the ingress and its middleware."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from prefixserve.cluster.responses import ErrorResponse


class ApiError(Exception):
    """An error with its HTTP status, rendered in OpenAI's envelope."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse.of(message, type_, param, code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=headers)
