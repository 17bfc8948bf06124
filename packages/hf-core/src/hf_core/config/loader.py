"""Load a recipe YAML plus dotted command-line overrides into a validated config.

OmegaConf does the YAML and the ``a.b.c=value`` overrides; pydantic does the typing.  Every
problem is reported as ``key: got value: expected ...`` so a typo in a 60-line recipe is found
in one read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from hf_core.errors import ConfigError, EngineConfigError

M = TypeVar("M", bound=BaseModel)


def _shown(value: Any) -> str:
    return "{...}" if isinstance(value, dict) else repr(value)


def _describe(errors: Sequence[Mapping[str, Any]], source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for error in errors:
        key = ".".join(str(part) for part in error["loc"]) or "<root>"
        if error["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (got {_shown(error['input'])})")
        elif error["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        else:
            lines.append(f"  {key}: got {_shown(error['input'])}: {error['msg']}")
    return "\n".join(lines)


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
        text = _describe(exc.errors(), source)
        if any(e["type"] == "extra_forbidden" for e in exc.errors()):
            text += f"\n  (known keys: {', '.join(sorted(model.model_fields))})"
        raise error(text) from None


def parse_engine_config(model: type[M], data: dict[str, Any] | M) -> M:
    """Validate an engine's settings (backends call this on their config class)."""
    return validate(model, data, model.__name__, EngineConfigError)


def load_config(model: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()) -> M:
    """Read ``path`` (YAML), apply ``key=value`` overrides, validate against ``model``."""
    source = str(path) if path else "overrides"
    try:
        base = OmegaConf.create({})
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"recipe file not found: {path}")
            base = OmegaConf.load(path)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot read configuration {source}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return validate(model, data, source)


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
