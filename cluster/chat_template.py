"""The sandboxed Jinja environment chat templates render in: transformers' own options,
extensions, filters and globals, so that a template renders byte for byte as
`apply_chat_template` renders it. Templates are data from a checkpoint: the sandbox keeps them
from reaching Python's internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, ClassVar

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or unusable, or a template failed."""


class TemplateRaised(Exception):
    """`raise_exception(...)` called from a chat template (e.g. roles out of order)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: JSON without Jinja's HTML escaping, with json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with it
    (for training masks); rendering a prompt just renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Macro) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the class's attributes (as transformers has it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace(...)` refusing underscore attributes, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: `self` may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)  # instance attributes are the namespace's keys
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not set {name!r} on a namespace")


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (sandboxed: templates are data):
    same options, extensions, filters and globals, so a template renders byte for byte alike."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _jinja_env()


def compile_chat_template(source: str) -> Template:
    """A chat template, compiled; a syntax error is a TokenizerError naming its line."""
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template line {exc.lineno}: {exc.message}") from None
