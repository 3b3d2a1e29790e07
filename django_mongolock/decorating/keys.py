"""Lock key templates: ``"invoice-{pk}"`` checked at decoration, formatted at each call."""

from __future__ import annotations

import functools
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from django_mongolock.validation import validate_key

__all__ = ["KeyTemplate", "template_fields"]

_FIELD_ROOT: Final = re.compile(r"[^.\[]*")


def template_fields(template: str) -> tuple[str, ...]:
    """The argument names a key template uses, checked for what ``str.format`` accepts."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"invalid lock key template {template!r}: {exc}") from exc
    names: list[str] = []
    for _text, field, spec, _conversion in parsed:
        if field is None:
            continue
        match = _FIELD_ROOT.match(field)
        root = match.group() if match else ""
        if not root.isidentifier():
            raise ValueError(
                f"lock key template {template!r} has the field {{{field}}}; fields must name "
                "an argument of the call, as in 'invoice-{pk}'"
            )
        if spec and "{" in spec:
            raise ValueError(f"lock key template {template!r} nests fields in a format spec")
        if root not in names:
            names.append(root)
    return tuple(names)


def _signature(target: Callable[..., Any]) -> inspect.Signature | None:
    # Django's method_decorator hands over a partial of the bound method whose __wrapped__
    # is the unbound function: its own signature (without self) is what calls bind to.
    follow = not isinstance(target, functools.partial)
    try:
        return inspect.signature(target, follow_wrapped=follow)
    except (TypeError, ValueError):  # some builtins and C callables have none
        return None


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A lock key, or a template formatted from the bound arguments of each call."""

    text: str
    fields: tuple[str, ...]
    signature: inspect.Signature | None
    name: str

    @classmethod
    def for_callable(
        cls, text: str, fields: tuple[str, ...], target: Callable[..., Any]
    ) -> KeyTemplate:
        """Check the template against ``target``'s parameters, when they are fixed."""
        signature = _signature(target) if fields else None
        name = getattr(target, "__qualname__", None) or repr(target)
        if signature is not None:
            params = signature.parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                missing = [field for field in fields if field not in params]
                if missing:
                    raise TypeError(
                        f"lock key template {text!r} names {', '.join(missing)}, but "
                        f"{name}() has no such parameter (it has: {', '.join(params) or 'none'})"
                    )
        return cls(text, fields, signature, name)

    def format(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        if not self.fields:
            return self.text.format()
        values = self._arguments(args, kwargs)
        missing = [name for name in self.fields if name not in values]
        if missing:
            raise TypeError(
                f"lock key template {self.text!r} of {self.name}() names "
                f"{', '.join(missing)}, which this call does not pass "
                f"(it passes: {', '.join(values) or 'nothing'})"
            )
        try:
            key = self.text.format_map(values)
        except (AttributeError, LookupError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot format lock key template {self.text!r}: {exc}") from exc
        return validate_key(key)

    def _arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults included and ``**kwargs`` spread out."""
        if self.signature is None:
            return dict(kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                values.update(value)
            else:
                values[name] = value
        return values
