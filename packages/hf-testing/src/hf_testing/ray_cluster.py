"""Helpers for the test suites of hf-core and of backend packages (no pytest import here)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hf_core.runtime import Cluster


@contextmanager
def local_ray_cluster(import_dirs: Sequence[Path] = (), num_cpus: int = 16) -> Iterator[Cluster]:
    """A private local Ray instance for a test session.

    ``import_dirs`` are put on the workers' ``PYTHONPATH`` so test-only worker classes import
    there too.  Token auth is off and Ray's files go to a temporary folder, so tests neither
    need nor touch the home folder.  ``num_cpus`` is logical: bundles are scheduling units.
    """
    extra = [str(p) for p in import_dirs]
    os.environ["PYTHONPATH"] = os.pathsep.join([*extra, os.environ.get("PYTHONPATH", "")])
    sys.path[:0] = [p for p in extra if p not in sys.path]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with tempfile.TemporaryDirectory(prefix="hf-ray-") as tmp:
        with Cluster(num_cpus=num_cpus, temp_dir=tmp) as cluster:
            yield cluster
