"""The schema machinery: a config key is a dataclass field made by :func:`setting` (its default, what it
means, the bound its value keeps); a dict read from YAML becomes dataclasses by the field annotations
(``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, ``list[...]``, ``tuple[...]``,
``Optional[...]`` and nested dataclasses), so adding a key is adding one line. Every problem is one
:class:`ConfigError` line naming the source and the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, Union

from parallel_latent.errors import BadInput

__all__ = [
    "FRACTION",
    "NOT_EMPTY",
    "POSITIVE",
    "SHARE",
    "Bound",
    "ConfigError",
    "Items",
    "at_least",
    "build_dataclass",
    "check_section",
    "describe_value",
    "holds_text",
    "require",
    "schema_keys",
    "schema_lookup",
    "setting",
    "unknown_key_hint",
]


class ConfigError(BadInput):
    """A configuration problem; the message is one line naming the source and key."""


def require(condition: bool, source: str, message: str) -> None:
    """A rule across keys: ConfigError ``<source>: <message>`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{source}: {message}")


@dataclass(frozen=True)
class Bound:
    """What a value must be: a test and the words of the one-line error (``<key>=<value> <must>``)."""

    test: Callable[[Any], bool]
    must: str
    show_value: bool = True  # "logging.run_dir must not be empty" names no value

    def problem(self, key: str, value: Any) -> str | None:
        if self.test(value):
            return None
        return f"{key}={value} {self.must}" if self.show_value else f"{key} {self.must}"


@dataclass(frozen=True)
class Items:
    """A list of ``count`` values, each within ``each``."""

    count: int
    each: Bound

    @property
    def must(self) -> str:
        return f"must have {self.count} items, each {self.each.must.removeprefix('must be ')}"

    def problem(self, key: str, values: list) -> str | None:
        if len(values) != self.count:
            return f"{key} must have {self.count} items, got {len(values)}"
        return next((p for i, v in enumerate(values) if (p := self.each.problem(f"{key}[{i}]", v))), None)


def at_least(minimum: int | float) -> Bound:
    return Bound(lambda value: value >= minimum, f"must be >= {minimum}")


POSITIVE = Bound(lambda value: value > 0, "must be > 0")
FRACTION = Bound(lambda value: 0.0 <= value < 1.0, "must be in [0, 1)")  # a probability that may not be 1
SHARE = Bound(lambda value: 0.0 <= value <= 1.0, "must be in [0, 1]")
NOT_EMPTY = Bound(lambda value: value != "", "must not be empty", show_value=False)


def setting(default: Any, doc: str, bound: Bound | Items | None = None) -> Any:
    """A config key: its default (a list default is copied per instance), its meaning and its bound."""
    metadata = {"doc": doc, "bound": bound}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def schema_keys(cls: type, prefix: str = "") -> list[tuple[str, Any, str, Bound | Items | None]]:
    """Every key of the schema ``cls``: (dotted key, default, meaning, bound), in the schema's order."""
    keys = []
    for item in dataclasses.fields(cls):
        key = f"{prefix}.{item.name}" if prefix else item.name
        if dataclasses.is_dataclass(item.default_factory if item.default_factory is not MISSING else None):
            keys += schema_keys(item.default_factory, key)
            continue
        default = item.default_factory() if item.default_factory is not MISSING else item.default
        keys.append((key, default, item.metadata.get("doc", ""), item.metadata.get("bound")))
    return keys


# Every number a config holds (a YAML file, a checkpoint's or a manifest's record) is one a run can
# use: no key of any section means anything past 2^31 - 1, and none means NaN or infinity.
INT_LIMIT = 2**31 - 1


def _out_of_range(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        return f"must be within +-{INT_LIMIT}"
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    return None


def _check_bounds(section: Any, source: str, prefix: str) -> None:
    for item in dataclasses.fields(section):
        value, key = getattr(section, item.name), f"{prefix}.{item.name}" if prefix else item.name
        if dataclasses.is_dataclass(value):
            _check_bounds(value, source, key)
            continue
        for element in value if isinstance(value, list | tuple) else (value,):
            if (wrong := _out_of_range(element)) is not None:
                raise ConfigError(f"{source}: {key} {wrong}, not {describe_value(element)}")
        if (bound := item.metadata.get("bound")) is not None and (problem := bound.problem(key, value)):
            raise ConfigError(f"{source}: {problem}")


def _check_rules(section: Any, source: str) -> None:
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if dataclasses.is_dataclass(value):
            _check_rules(value, source)
    if hasattr(section, "validate"):
        section.validate(source)


def check_section(section: Any, source: str, prefix: str = "") -> None:
    """Every key's value within its bound (:func:`setting`), sections recursively; then each
    section's own rules across its keys (its ``validate(source)``), inner sections first."""
    _check_bounds(section, source, prefix)
    _check_rules(section, source)


# --------------------------------------------------------------------------- #
# dict -> dataclass.
# --------------------------------------------------------------------------- #

_NONE_TYPE = type(None)
# A decimal number as people write it: 3, -0.5, .5, 5e-3, 1E-4, 3.0e+2 (no inf/nan, no underscores).
FLOAT_LITERAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def describe_value(value: Any) -> str:
    """A short, single-line rendering of a value for error messages."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if origin in (list, tuple):
        return f"{origin.__name__} of {_type_name(typing.get_args(annotation)[0])}"
    if annotation is _NONE_TYPE:
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def unknown_key_hint(leaf: str, known: list[str]) -> str:
    """``, did you mean 'x'? (known: a, b, ...)`` for a key not among ``known``."""
    guesses = difflib.get_close_matches(leaf, known, n=1)
    hint = f", did you mean '{guesses[0]}'?" if guesses else ""
    return hint + (f" (known: {', '.join(known)})" if known else "")


def _wrong_type(value: Any, annotation: Any, key: str, source: str) -> ConfigError:
    return ConfigError(
        f"{source}: {key}: expected {_type_name(annotation)}, got {type(value).__name__} {describe_value(value)}"
    )


def _convert_union(value: Any, annotation: Any, key: str, source: str) -> Any:
    options = typing.get_args(annotation)
    if value is None and _NONE_TYPE in options:
        return None
    for option in options:
        if option is _NONE_TYPE:
            continue
        try:
            return _convert(value, option, key, source)
        except ConfigError:
            continue
    raise _wrong_type(value, annotation, key, source)


def _convert_literal(value: Any, annotation: Any, key: str, source: str) -> Any:
    choices = typing.get_args(annotation)
    if isinstance(value, bool) and {"on", "off"} <= set(choices):
        value = "on" if value else "off"  # YAML 1.1 (PyYAML) reads an unquoted on / off as a bool
    if value not in choices or isinstance(value, bool):
        raise ConfigError(
            f"{source}: {key}: {describe_value(value)} is not one of {', '.join(str(choice) for choice in choices)}"
        )
    return value


def _convert_sequence(value: Any, annotation: Any, key: str, source: str) -> list | tuple:
    origin = typing.get_origin(annotation)
    if not isinstance(value, (list, tuple)):
        raise _wrong_type(value, annotation, key, source)
    item_types = typing.get_args(annotation)
    if origin is tuple and not (len(item_types) == 2 and item_types[1] is Ellipsis):
        if len(value) != len(item_types):
            raise ConfigError(f"{source}: {key}: expected {len(item_types)} items, got {len(value)}")
    else:
        item_types = (item_types[0],) * len(value)
    items = [
        _convert(item, item_type, f"{key}[{index}]", source)
        for index, (item, item_type) in enumerate(zip(value, item_types, strict=True))
    ]
    return items if origin is list else tuple(items)


def _convert_scalar(value: Any, annotation: Any, key: str, source: str) -> Any:
    # bool is a subclass of int in Python, but `true` for a size is a mistake.
    if annotation is float and isinstance(value, str) and FLOAT_LITERAL.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 (PyYAML) reads 5e-3 and 1E-4 as strings: only 5.0e-3 is a float there
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(annotation)
    if accepted is None:
        raise TypeError(f"config schema uses an unsupported annotation {annotation!r} at {key}")
    if not isinstance(value, accepted) or (annotation is not bool and isinstance(value, bool)):
        raise _wrong_type(value, annotation, key, source)
    return float(value) if annotation is float else value


def _convert(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check ``value`` against ``annotation`` and return it in canonical form."""
    if dataclasses.is_dataclass(annotation):
        if value is None:  # an empty section ("model:") means all defaults
            value = {}
        if not isinstance(value, dict):
            raise _wrong_type(value, annotation, key, source)
        return build_dataclass(annotation, value, source, key)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):  # Optional[X] and friends
        return _convert_union(value, annotation, key, source)
    if origin is Literal:
        return _convert_literal(value, annotation, key, source)
    if origin in (list, tuple):
        return _convert_sequence(value, annotation, key, source)
    return _convert_scalar(value, annotation, key, source)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_dataclass(cls: type, data: dict, source: str = "<dict>", prefix: str = "") -> Any:
    """Validate a dict into dataclass ``cls`` (recursively), without the rules across keys.
    ``prefix`` is the dotted key of ``data`` in its file."""
    field_types = _field_types(cls)
    for name in data:
        if name not in field_types:
            key = f"{prefix}.{name}" if prefix else str(name)
            raise ConfigError(f"{source}: {key}: unknown key{unknown_key_hint(key.split('.')[-1], list(field_types))}")
    values = {
        name: _convert(data[name], annotation, f"{prefix}.{name}" if prefix else name, source)
        for name, annotation in field_types.items()
        if name in data
    }
    return cls(**values)


def schema_lookup(schema: type, dotted_key: str) -> tuple[Any, list[str]]:
    """Annotation of ``dotted_key`` in ``schema``, or KeyError with the keys known at the level
    where the lookup failed."""
    annotation: Any = schema
    for part in dotted_key.split("."):
        if not dataclasses.is_dataclass(annotation):
            raise KeyError([])
        field_types = _field_types(annotation)
        if part not in field_types:
            raise KeyError(list(field_types))
        annotation = field_types[part]
    return annotation, []


def holds_text(annotation: Any) -> bool:
    """A string key, or one of a few words (``auto | on | off``): an override's text is meant as is."""
    if annotation is str:
        return True
    return typing.get_origin(annotation) is Literal and all(isinstance(c, str) for c in typing.get_args(annotation))
