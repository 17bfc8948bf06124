"""Shared fixtures: one local Ray instance per test session (starting Ray costs ~12 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf_testing.ray_cluster import local_ray_cluster


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster([Path(__file__).parent]):
        yield
