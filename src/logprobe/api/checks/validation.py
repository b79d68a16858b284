"""Field checks with the contract's exact messages.

Every numeric field answers with the same templates (docs/api.md, section 2.1):
  `Invalid type for 'NAME': expected a number or null.`
  `Invalid value for 'NAME': expected a value greater than or equal to MIN.`
  `Invalid value for 'NAME': expected a value less than or equal to MAX.`
`null` for an optional field means its default, as in the OpenAI API.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from ..errors import InvalidRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MISSING = object()


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def type_error(name: str, expected: str, nullable: bool = True) -> InvalidRequest:
    tail = " or null" if nullable else ""
    return InvalidRequest(f"Invalid type for '{name}': expected {expected}{tail}.", name)


def value_error(name: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{name}': expected {expected}.", name)


def check_bounds(name: str, value, ge=None, le=None, gt=None) -> None:
    if ge is not None and value < ge:
        raise value_error(name, f"a value greater than or equal to {_fmt(ge)}")
    if gt is not None and value <= gt:
        raise value_error(name, f"a value greater than {_fmt(gt)}")
    if le is not None and value > le:
        raise value_error(name, f"a value less than or equal to {_fmt(le)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def get_int(body: dict, name: str, default, *, ge=INT64_MIN, le=INT64_MAX):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not _is_number(value):
        raise type_error(name, "a number")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise type_error(name, "an integer")
        # JSON integers beyond 64 bits reach here as floats (rounded: -2**63 - 1 reads as -2**63), so a
        # float at or past the int64 bounds cannot be checked exactly: it is outside them.
        if ge is not None and ge <= INT64_MIN and value <= INT64_MIN:
            raise value_error(name, f"a value greater than or equal to {_fmt(ge)}")
        if le is not None and le >= INT64_MAX and value >= 2.0**63:
            raise value_error(name, f"a value less than or equal to {_fmt(le)}")
        value = int(value)
    check_bounds(name, value, ge=ge, le=le)
    return value


def get_number(body: dict, name: str, default, *, ge=None, le=None, gt=None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not _is_number(value) or not math.isfinite(value):
        raise type_error(name, "a number")
    check_bounds(name, value, ge=ge, le=le, gt=gt)
    return float(value)


def get_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean")
    return value


def get_str(body: dict, name: str, default=None, *, required: bool = False):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise InvalidRequest(f"Missing required parameter: '{name}'.", name)
        return default
    if not isinstance(value, str):
        raise type_error(name, "a string", nullable=not required)
    return value


def get_stop(body: dict, name: str = "stop", max_items: int = 4) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise type_error(name, "a string or an array of strings")
    if len(value) > max_items:
        raise value_error(name, f"at most {max_items} stop sequences")
    if any(s == "" for s in value):
        raise value_error(name, "non-empty stop sequences")
    return value


def check_known_fields(body: dict, known: set[str], unimplemented: dict[str, tuple]) -> None:
    """Refuse unknown fields by name. Known OpenAI fields that logprobe does not implement are taken
    only at their neutral values (e.g. `presence_penalty: 0`), so clients that always send them work."""
    for name, value in body.items():
        if name in known:
            continue
        if name in unimplemented:
            if value in unimplemented[name]:
                continue
            neutral = orjson.dumps(unimplemented[name][-1]).decode()  # as JSON writes it: null, not None
            raise InvalidRequest(
                f"Unsupported request argument supplied: {name} (logprobe does not implement it; "
                f"leave it out or send {neutral}).", name)
        raise InvalidRequest(f"Unrecognized request argument supplied: {name}", name)
