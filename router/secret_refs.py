"""Secrets by reference: a setting may name where its value lives instead of holding it.

``env:NAME`` reads the environment variable NAME, ``file:/path`` reads the file (a mounted
Kubernetes secret, say); anything else is the value itself. Serve shows deployment arguments in
its dashboard and REST API, so a password-bearing Redis URL is passed to deployments as a
reference and resolved in the replica that uses it.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ENV_PREFIX = "env:"
FILE_PREFIX = "file:"


class SecretNotFound(LookupError):
    """A reference whose variable is unset or whose file cannot be read, here."""


def is_reference(value: str) -> bool:
    return value.startswith((ENV_PREFIX, FILE_PREFIX))


def env_reference(name: str) -> str:
    return ENV_PREFIX + name


def resolve(value: str) -> str:
    """The value a reference names (stripped of surrounding whitespace), or ``value`` itself."""
    if value.startswith(ENV_PREFIX):
        name = value.removeprefix(ENV_PREFIX)
        found = os.environ.get(name)
        if not found:
            raise SecretNotFound(f"environment variable {name} is not set in this process")
        return found.strip()
    if value.startswith(FILE_PREFIX):
        path = Path(value.removeprefix(FILE_PREFIX)).expanduser()
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise SecretNotFound(f"cannot read {path}: {exc.strerror}") from None
    return value


def url_has_secret(url: str) -> bool:
    """A password in the URL's user info or in a ``password`` query parameter."""
    parts = urlsplit(url)
    query = {key.lower() for key in parse_qs(parts.query)}
    return bool(parts.password) or "password" in query
