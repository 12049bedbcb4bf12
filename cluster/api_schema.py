"""How the ingress reads a request body and documents it: strict parsing into a request model
(a 400 that names the field) and the OpenAPI schema that clients and the fuzz tests
(schemathesis) generate requests from."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, ValidationError

from prefixserve.cluster.errors import ApiError

Body = TypeVar("Body", bound=BaseModel)


class RequestModel(BaseModel):
    """A request body or part of one: no string-to-number coercion, NaN and infinities
    refused, unknown fields ignored (SDKs send fields the server does not act on)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The request body as `model`; strict errors name the offending field (`param`)."""
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        message, param = format_validation_error(exc)
        raise ApiError(400, message, param=param) from None


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route that parses its own body (strict errors, 413 limit):
    the schema clients and the fuzz tests (schemathesis) generate requests from."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}},
            "x-defs": defs}


def openapi_schema(api: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request models' nested definitions under components."""
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path in schema["paths"].values():
            for op in path.values():
                components.update(op.pop("x-defs", {}))
        api.openapi_schema = schema
    return api.openapi_schema


def format_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter, from pydantic's error list."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors(include_url=False)[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            return f"request body is not valid JSON: {msg}", None
        if param is None and loc:
            param = loc
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts), param
