"""Config files and command-line overrides: a YAML file (one mapping per section) read, ``key.sub=value``
overrides applied, and the result validated into a :class:`.sections.Config`; the final config
written back as YAML for the run's record. A key that is unknown, has the wrong type or makes an
impossible combination stops the program before any work with one line naming the file and the
dotted key, e.g.::

    configs/x.yaml: model.n_headz: unknown key, did you mean 'n_heads'? (known: d_model, ...)
    configs/x.yaml: parallel.tensor_parallel=3 does not divide model.n_heads=4
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import yaml

from .schema import (
    ConfigError,
    build_dataclass,
    check_section,
    describe_value,
    holds_text,
    schema_lookup,
    unknown_key_hint,
)
from .sections import EXPORT_SECTION, FEATURE_MODEL_TOKENIZER, Config, ExportConfig, TokenizerConfig, validate_config

__all__ = [
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "export_config_from_dict",
    "load_config",
    "save_config",
]


def export_config_from_dict(values: dict | None, source: str = "<dict>") -> ExportConfig:
    """Validate the ``export`` settings (keys without the section prefix) into an ExportConfig."""
    cfg = build_dataclass(ExportConfig, values or {}, source, EXPORT_SECTION)
    check_section(cfg, source, EXPORT_SECTION)
    return cfg


def config_from_dict(data: dict | None, source: str = "<dict>") -> Config:
    """Validate a nested dict (as read from YAML) into a Config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    cfg = build_dataclass(Config, data, source)
    if cfg.tokenizer.name_or_path == FEATURE_MODEL_TOKENIZER:  # recorded as what it names
        cfg = dataclasses.replace(cfg, tokenizer=TokenizerConfig(name_or_path=cfg.feature_model.name_or_path))
    return validate_config(cfg, source)


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (lists, not tuples) that config_from_dict reads back."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain(dataclasses.asdict(cfg))


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    """Apply ``section.key=value`` overrides to a raw config dict (a copy is returned).

    The value is parsed with ``yaml.safe_load`` (``10`` -> int, ``0.0`` -> float,
    ``[0.9,0.99]`` -> list, ``null`` -> None); for a string field a value that
    YAML would read as something else (``run_dir=2024``, ``path=``) stays text.
    """
    result = copy.deepcopy(data) if data else {}
    for override in overrides:
        key, separator, raw_value = override.partition("=")
        key = key.strip()
        if not separator or not key:
            raise ConfigError(f"{source}: override {override!r}: expected key.sub=value")
        try:
            annotation, _ = schema_lookup(Config, key)
        except KeyError as error:
            hint = unknown_key_hint(key.split(".")[-1], error.args[0])
            raise ConfigError(f"{source}: override {override!r}: unknown key {key}{hint}") from None
        try:
            value = yaml.safe_load(raw_value) if raw_value.strip() else ""
        except yaml.YAMLError:
            value = raw_value
        if holds_text(annotation) and not isinstance(value, str):
            value = raw_value
        *parents, leaf = key.split(".")
        node = result
        for part in parents:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: {part}: expected a mapping, got {describe_value(child)}")
            node = child
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            node[leaf] = {**node[leaf], **value}  # `model={d_model: 32}` updates the section
        else:
            node[leaf] = value
    return result


def refuse_repeated_keys(node: yaml.Node, source: str, path: str = "") -> None:
    """A key given twice in one mapping (a ``training:`` section written twice, say) is refused with
    the dotted key and both lines: YAML would keep the second silently and lose the first."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            refuse_repeated_keys(item, source, path)
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value)
        dotted = f"{path}.{key}" if path else key
        line = key_node.start_mark.line + 1
        if key in first_line and key_node.tag != "tag:yaml.org,2002:merge":
            raise ConfigError(f"{source}: {dotted}: given twice, at lines {first_line[key]} and {line}")
        first_line.setdefault(key, line)
        refuse_repeated_keys(value_node, source, dotted)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply ``key.sub=value`` overrides, validate."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{source}: cannot read config file: {error}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            refuse_repeated_keys(node, source)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    if overrides:
        data = apply_overrides(data or {}, list(overrides), source)
    return config_from_dict(data, source)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the final (validated, overridden) config as YAML, for the run's record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config_to_dict(cfg), handle, sort_keys=False, default_flow_style=None)
