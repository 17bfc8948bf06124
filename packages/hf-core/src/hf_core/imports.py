"""``package.module:attr`` references in recipes (tools, environments), resolved to objects."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str) -> Any:
    """The object ``spec`` names (``attr`` may be dotted: ``module:Class.method``); raises
    ImportError or AttributeError for the caller to word for its recipe key."""
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
