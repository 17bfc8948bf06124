"""Load a recipe YAML plus dotted command-line overrides into a validated config.

OmegaConf does the YAML and the ``a.b.c=value`` overrides; pydantic does the typing.  Every
problem is reported as ``key: got value: expected ...`` so a typo in a 60-line recipe is found
in one read.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from hf_core.errors import ConfigError, EngineConfigError

M = TypeVar("M", bound=BaseModel)


def _shown(value: Any) -> str:
    return "{...}" if isinstance(value, dict) else repr(value)


def _describe(
    errors: Sequence[Mapping[str, Any]], source: str, model: type[BaseModel] | None = None
) -> str:
    lines = [f"invalid configuration ({source}):"]
    for error in errors:
        key = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "value_error" and (
            not error["loc"] or isinstance(error["input"], Mapping)
        ):
            # a cross-field check (a model validator, the whole schema's or a block's): its
            # text names the keys
            lines.append(f"  {_validator_text(error['msg'])}")
        elif error["type"] == "extra_forbidden":
            hint = _unknown_key_hint(model, tuple(error["loc"])) if model else ""
            lines.append(f"  {key}: unknown key (got {_shown(error['input'])}){hint}")
        elif error["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: got {_shown(error['input'])}: {_validator_text(error['msg'])}")
    return "\n".join(lines)


def _unknown_key_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``; did you mean rollout.max_staleness? (keys of rollout: ...)``: the keys of the block
    the unknown key sits in (not the top level's) and the closest of them, if any is close."""
    block: type[BaseModel] | None = model
    for part in loc[:-1]:
        if block is None:
            return ""
        field = block.model_fields.get(str(part))
        block = _nested_model(field.annotation) if field is not None else None
    if block is None:
        return ""  # inside a free-form mapping or a list: nothing to suggest
    known = sorted(block.model_fields)
    parent = ".".join(str(p) for p in loc[:-1])
    where = f"keys of {parent}" if parent else "known keys"
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    guess = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""
    return f"{guess} ({where}: {', '.join(known)})"


def _validator_text(msg: str) -> str:
    """A model validator's own message, without pydantic's "Value error, " prefix."""
    prefix = "Value error, "
    return msg[len(prefix) :] if msg.startswith(prefix) else msg


def validate(
    model: type[M],
    data: dict[str, Any] | M,
    source: str = "config",
    error: type[ConfigError] = ConfigError,
) -> M:
    """``model(**data)`` (or ``data`` itself if already a ``model``) with one error naming
    every bad key, the value given and what was expected."""
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(_describe(exc.errors(), source, model)) from None


def parse_engine_config(model: type[M], data: dict[str, Any] | M) -> M:
    """Validate an engine's settings (backends call this on their config class)."""
    return validate(model, data, model.__name__, EngineConfigError)


def load_config(model: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()) -> M:
    """Read ``path`` (YAML), apply ``key=value`` overrides, validate against ``model``."""
    source = str(path) if path else "overrides"
    try:
        base = OmegaConf.create({})
        if path is not None:
            base = _load_yaml(Path(path))
        bad = [o for o in overrides if "=" not in o or o.startswith("=")]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}; e.g. rollout.n=8")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot read configuration {source}: {_one_line(str(exc))}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return validate(model, data, source)


def _load_yaml(path: Path) -> Any:
    """The recipe's YAML; a :class:`ConfigError` naming the file, line and column if it is
    missing or not YAML (PyYAML's own error is several lines and a traceback)."""
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        where = "" if path.is_absolute() else f" (absolute: {path.absolute()})"
        raise ConfigError(f"recipe file {what}: {path}{where}")
    try:
        return OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"recipe {path}{_yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path}: YAML syntax error: {_one_line(str(exc))}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {path}: not a text file ({exc.reason})") from None


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """``, line L, column C: YAML syntax error: what (while ... started at line L', column C')``
    with 1-based positions, as an editor shows them."""

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark = exc.problem_mark or exc.context_mark
    text = f", {at(mark)}" if mark else ""
    text += f": YAML syntax error: {exc.problem or exc.context or 'not valid YAML'}"
    if exc.context and exc.problem:
        started = f" started at {at(exc.context_mark)}" if exc.context_mark else ""
        text += f" ({exc.context}{started})"
    return text


def _one_line(text: str) -> str:
    """OmegaConf and PyYAML messages carry ``full_key``/``object_type`` lines; keep them on
    one line so the CLI prints one paragraph."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every field, nested models expanded."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        nested = _nested_model(annotation)
        if nested is not None:
            rows.extend(describe_fields(nested, key + "."))
            continue
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = str(value) if isinstance(value, Path) else repr(value)
        rows.append((key, default, field.description or ""))
    return rows


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
