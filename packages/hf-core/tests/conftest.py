"""Shared fixtures: one local Ray instance per test session (starting Ray costs ~12 s)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    from hf_core.runtime import Cluster

    # Worker processes import the test worker classes from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(TESTS_DIR))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with tempfile.TemporaryDirectory(prefix="hf-ray-") as tmp:
        # Logical CPUs: bundles are scheduling units here, not cores.
        with Cluster(num_cpus=16, temp_dir=tmp):
            yield
