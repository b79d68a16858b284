"""What every request model shares: one pydantic model per body declares its fields (type, default,
bounds, description), and from that one declaration come both the OpenAPI schema (pydantic's
`model_json_schema`) and the checks, with the contract's exact messages (validation.py's templates).

`RequestModel.parse(body, limits)` checks a JSON object in this order, stopping at the first refusal:
unknown fields (in the body's order), then each declared field in the model's order, then the model's
cross-field rules (`@check` methods, in the order written, a base class's first). A field is checked by
its declared type (int, float, bool, str, a Literal of strings, each optional or not), with the bounds
of its `Field(ge=, gt=, le=)`, or by its own `@parses(name)` function where the shape needs more. After
`parse`, each field holds its checked value; a field with its own parser holds what that parser returns.

pydantic's own validation is not used: its messages and coercions (`"4"` -> 4) are not the contract's,
and it collects every error where the contract answers the first.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from ...config import Limits
from . import validation as v

DEFAULT_LIMITS = Limits()  # the bounds the schema shows: each cap at its default


class Cap:
    """Field metadata: the upper bound is this server option (a `Limits` field), not the schema's `le`,
    which shows the option's default."""

    def __init__(self, limit: str):
        self.limit = limit


class Unbounded:
    """Field metadata: an integer without an upper bound here (a later check bounds it, e.g. by the
    model's context), rather than the int64 range every other integer has."""


class Neutral:
    """Field metadata: an OpenAI field logprobe does not implement, accepted only at these values; the
    last one is the value the refusal suggests."""

    def __init__(self, *values):
        self.values = values


def parses(name: str):
    """Mark a function `(value, limits) -> checked value` as the check of field `name` (`value` is None
    when the field is missing or null)."""
    def mark(fn):
        fn.parses_field = name
        return staticmethod(fn)
    return mark


def check(fn):
    """Mark a method `(self, limits) -> None` as a cross-field rule, run after every field is checked."""
    fn.is_cross_check = True
    return fn


def _metadata(info, kind):
    return next((m for m in info.metadata if isinstance(m, kind)), None)


def _bound(info, name: str):
    """A `Field(ge=, gt=, le=)` bound (pydantic keeps each as an annotated_types object in metadata)."""
    return next((getattr(m, name) for m in info.metadata if hasattr(m, name)), None)


def _plain_type(annotation):
    """`int | None` -> int; a Literal stays itself."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def quoted_choices(values) -> str:
    """`'raw', 'processed' or 'both'`."""
    quoted = [f"'{x}'" for x in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def declared_check(name: str, info) -> Callable[[dict, Limits], Any]:
    """The check of one field by its declared type and bounds (the templates of docs/api.md section
    2.1), as a function of (body, limits); the declaration is read once, here."""
    kind = _plain_type(info.annotation)
    default = None if info.is_required() else info.default
    if kind is bool:
        return lambda body, limits: v.get_bool(body, name, default)
    if kind is str:
        required = info.is_required()
        return lambda body, limits: v.get_str(body, name, default, required=required)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)

        def check_choice(body, limits):
            value = v.get_str(body, name, default)
            if value is not None and value not in choices:
                raise v.value_error(name, quoted_choices(choices))
            return value
        return check_choice
    ge = _bound(info, "ge")
    gt = _bound(info, "gt")
    le = _bound(info, "le")
    cap = _metadata(info, Cap)
    if kind is int:
        ge = v.INT64_MIN if ge is None else ge  # JSON integers are int64 here
        le = None if _metadata(info, Unbounded) else v.INT64_MAX if le is None else le
        if cap is not None:  # the server's value of the option, not the schema's default
            return lambda body, limits: v.get_int(body, name, default, ge=ge, le=getattr(limits, cap.limit))
        return lambda body, limits: v.get_int(body, name, default, ge=ge, le=le)
    if kind is float and cap is None:
        return lambda body, limits: v.get_number(body, name, default, ge=ge, le=le, gt=gt)
    raise TypeError(f"{name}: a field of type {info.annotation} needs its own @parses function")


class RequestModel(BaseModel):
    """A request body: its fields in OpenAI's order, logprobe's extensions in a marked block after them."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    @functools.cache
    def parsers(cls) -> dict[str, Any]:
        """Each field's own check, by field name (from `@parses` functions, a subclass's winning)."""
        found = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass).values():
                fn = getattr(attr, "__func__", attr)
                name = getattr(fn, "parses_field", None)
                if name is not None:
                    found[name] = fn
        return found

    @classmethod
    @functools.cache
    def cross_checks(cls) -> tuple:
        """The `@check` rules, in the order written, a base class's first."""
        seen, out = set(), []
        for klass in reversed(cls.__mro__):
            for key, attr in vars(klass).items():
                if getattr(attr, "is_cross_check", False) and key not in seen:
                    seen.add(key)
                    out.append(getattr(cls, key))
        return tuple(out)

    @classmethod
    @functools.cache
    def neutral_values(cls) -> dict[str, tuple]:
        """The OpenAI fields logprobe does not implement, with the values it takes for them."""
        return {name: marker.values for name, info in cls.model_fields.items()
                if (marker := _metadata(info, Neutral)) is not None}

    @classmethod
    @functools.cache
    def implemented_fields(cls) -> frozenset[str]:
        return frozenset(cls.model_fields) - set(cls.neutral_values())

    @classmethod
    @functools.cache
    def required_fields(cls) -> frozenset[str]:
        return frozenset(name for name, info in cls.model_fields.items() if info.is_required())

    @classmethod
    @functools.cache
    def field_checks(cls) -> tuple:
        """(name, check(body, limits)) for each field in order; the neutral-only fields are checked with
        the unknown ones."""
        own = cls.parsers()
        checks = []
        for name, info in cls.model_fields.items():
            if _metadata(info, Neutral) is not None:
                continue
            if name in own:
                checks.append((name, lambda body, limits, fn=own[name], name=name: fn(body.get(name), limits)))
            else:
                checks.append((name, declared_check(name, info)))
        return tuple(checks)

    @classmethod
    def check_known_fields(cls, body: dict) -> None:
        v.check_known_fields(body, cls.implemented_fields(), cls.neutral_values())

    @classmethod
    def parse(cls, body: dict, limits: Limits):
        """The body checked (400 `invalid_request` at the first fault) -> the model, fields checked."""
        cls.check_known_fields(body)
        req = cls.model_construct(**{name: check(body, limits) for name, check in cls.field_checks()})
        for rule in cls.cross_checks():
            rule(req, limits)
        return req
