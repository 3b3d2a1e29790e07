"""What a decorated call is: a management command, a view, or a plain function.

Told apart by the classes of its arguments, looked up only among modules already imported,
so ``@locked`` on plain functions never imports Django's HTTP and command machinery.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["Kind", "call_kind", "loaded_class"]

Kind: TypeAlias = Literal["function", "view", "command"]


def loaded_class(module: str, name: str) -> type[Any] | None:
    """A class of a module that is already imported, else None: no instance can exist yet.

    Keeps ``@locked`` on plain functions from importing Django's HTTP and command machinery.
    """
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None)
    return found if isinstance(found, type) else None


def as_request(value: object) -> HttpRequest | None:
    request_class = loaded_class("django.http.request", "HttpRequest")
    if request_class is None:
        return None
    if isinstance(value, request_class):
        return cast("HttpRequest", value)
    # Django REST framework's Request wraps Django's.
    wrapper_class = loaded_class("rest_framework.request", "Request")
    if wrapper_class is not None and isinstance(value, wrapper_class):
        inner = getattr(value, "_request", None)
        return cast("HttpRequest", inner) if isinstance(inner, request_class) else None
    return None


def call_kind(args: Sequence[Any]) -> tuple[Kind, Any]:
    """A command when called with the command first; a view when a request comes first or
    second (after ``self``); a plain function otherwise."""
    if not args:
        return "function", None
    command_class = loaded_class("django.core.management.base", "BaseCommand")
    if command_class is not None and isinstance(args[0], command_class):
        return "command", args[0]
    for value in args[:2]:
        request = as_request(value)
        if request is not None:
            return "view", request
    return "function", None
