"""Device profiles and the cluster shape the cost model reads.

Peak numbers come from vendor sheets; the ``*_efficiency`` / ``mfu_*`` fields say what fraction
of a peak real kernels reach, and are what a measured profile JSON calibrates.  Everything is a
plain pydantic model so YAML (through OmegaConf) can override any field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

GIB = 1024**3
GB = 1e9


class DeviceProfile(BaseModel):
    """One accelerator type and the node it usually sits in.

    Bandwidths are GB/s (1e9 bytes/s).  ``intra_node_bandwidth_gbs`` is per device, one
    direction (NVLink); ``inter_node_bandwidth_gbs`` is the whole node's network bandwidth,
    which all devices of the node share when they talk across nodes at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    memory_gib: float = Field(gt=0)
    peak_tflops: float = Field(gt=0, description="dense bf16 peak, TFLOP/s")
    memory_bandwidth_gbs: float = Field(gt=0)
    intra_node_bandwidth_gbs: float = Field(gt=0)
    inter_node_bandwidth_gbs: float = Field(gt=0)
    mfu_train: float = Field(0.45, gt=0, le=1, description="achieved/peak FLOPs in training")
    mfu_infer: float = Field(0.5, gt=0, le=1, description="achieved/peak FLOPs in forward passes")
    memory_bandwidth_efficiency: float = Field(0.75, gt=0, le=1)
    comm_efficiency: float = Field(0.8, gt=0, le=1, description="bus bandwidth / link bandwidth")
    usable_memory_fraction: float = Field(
        0.9, gt=0, le=1, description="share of memory left after runtime, NCCL and fragmentation"
    )
    collective_latency_us: float = Field(15.0, ge=0, description="fixed cost of one collective")
    decode_step_overhead_ms: float = Field(
        0.0, ge=0, description="rollout engine's per-step host work (scheduling, sampling)"
    )
    op_overhead_s: float = Field(
        0.0, ge=0, description="fixed seconds per model call (dispatch, data transfer, switch)"
    )

    @property
    def memory_bytes(self) -> float:
        """Capacity in bytes."""
        return self.memory_gib * GIB

    @property
    def usable_bytes(self) -> float:
        """The budget the planner fits models into (capacity x usable fraction)."""
        return self.memory_bytes * self.usable_memory_fraction

    def train_flops(self) -> float:
        """Achievable FLOP/s of a training step."""
        return self.peak_tflops * 1e12 * self.mfu_train

    def infer_flops(self) -> float:
        """Achievable FLOP/s of a forward pass (inference, prefill)."""
        return self.peak_tflops * 1e12 * self.mfu_infer

    def memory_bandwidth(self) -> float:
        """Achievable HBM bytes/s: what bounds decoding."""
        return self.memory_bandwidth_gbs * GB * self.memory_bandwidth_efficiency


_PEAKS: dict[str, tuple[str, float, float, float, float, float]] = {
    # name, memory GiB, dense bf16 TFLOP/s, HBM GB/s, NVLink GB/s per device, node network GB/s
    "a100-80g": ("A100-80G", 80, 312, 2039, 300, 200),
    "a100-40g": ("A100-40G", 40, 312, 1555, 300, 200),
    "h100": ("H100-SXM-80G", 80, 989, 3350, 450, 400),
    "h200": ("H200-SXM-141G", 141, 989, 4800, 450, 400),
    "cpu": ("CPU host", 64, 1.0, 100, 20, 12.5),
}
"""Vendor peaks (dense bf16); the defaults for inter-node bandwidth are a DGX-like node
(8 x 200 Gb/s for A100, 8 x 400 Gb/s for H100/H200).  Override per cluster where it differs."""

_PEAK_FIELDS = (
    "name",
    "memory_gib",
    "peak_tflops",
    "memory_bandwidth_gbs",
    "intra_node_bandwidth_gbs",
    "inter_node_bandwidth_gbs",
)

_ACHIEVED: dict[str, dict[str, float]] = {
    "cpu": {
        "mfu_train": 0.3,
        "mfu_infer": 0.3,
        "memory_bandwidth_efficiency": 0.6,
        "comm_efficiency": 0.5,
        "collective_latency_us": 50.0,
    },
}
"""Where a device reaches other shares of its peaks, or another collective latency, than the
defaults (a host's numbers are rough; a measured profile calibrates them)."""

PROFILES: dict[str, DeviceProfile] = {
    key: DeviceProfile.model_validate(
        {**dict(zip(_PEAK_FIELDS, peaks, strict=True)), **_ACHIEVED.get(key, {})}
    )
    for key, peaks in _PEAKS.items()
}
"""The named profiles: :data:`_PEAKS`, with the defaults or :data:`_ACHIEVED` for the rest."""

_ALIASES = {
    "a100": "a100-80g",
    "a100-80gb": "a100-80g",
    "a100-40gb": "a100-40g",
    "h100-80g": "h100",
    "h100-sxm": "h100",
    "h200-141g": "h200",
    "host": "cpu",
}

_MEASURED = {
    "measured_train_tflops": ("mfu_train", "peak_tflops"),
    "measured_infer_tflops": ("mfu_infer", "peak_tflops"),
    "measured_memory_bandwidth_gbs": ("memory_bandwidth_efficiency", "memory_bandwidth_gbs"),
    "measured_intra_node_busbw_gbs": ("comm_efficiency", "intra_node_bandwidth_gbs"),
}
"""Measured absolute numbers a profile may carry, and the fraction each one calibrates."""


def device_profile(
    name: str | DeviceProfile,
    overrides: Mapping[str, Any] | None = None,
    profile: str | Path | Mapping[str, Any] | None = None,
) -> DeviceProfile:
    """A named profile, then YAML-style field overrides, then a measured calibration."""
    if isinstance(name, DeviceProfile):
        device = name
    else:
        key = name.strip().lower()
        key = _ALIASES.get(key, key)
        if key not in PROFILES:
            raise ValueError(f"unknown device {name!r}; expected one of {sorted(PROFILES)}")
        device = PROFILES[key]
    if overrides:
        device = _validated({**device.model_dump(), **dict(overrides)}, "device override")
    if profile is not None:
        device = calibrate(device, profile)
    return device


def calibrate(device: DeviceProfile, profile: str | Path | Mapping[str, Any]) -> DeviceProfile:
    """Fold a measured profile (a JSON file or dict) into the achievable fractions.

    Keys may be profile fields (``mfu_train: 0.38``) or measurements turned into fractions of
    the peak (``measured_train_tflops: 120`` on a 312 TFLOP/s device gives ``mfu_train`` 0.385).
    Unknown keys are an error, so a typo cannot silently leave a default in place.
    """
    if isinstance(profile, Mapping):
        measured = profile
    else:
        with Path(profile).open() as fh:
            measured = json.load(fh)
    values = device.model_dump()
    for key, value in measured.items():
        if key in _MEASURED:
            fraction, peak = _MEASURED[key]
            values[fraction] = min(1.0, float(value) / values[peak])
        elif key in values and key != "name":
            values[key] = value
        else:
            allowed = sorted([*_MEASURED, *(k for k in values if k != "name")])
            raise ValueError(f"device profile key {key!r} is not one of {allowed}")
    return _validated(values, "device profile")


def _validated(values: Mapping[str, Any], source: str) -> DeviceProfile:
    """Validate profile fields; a bad one is named with what was wrong and what was given."""
    try:
        return DeviceProfile.model_validate(dict(values))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise ValueError(f"{source}: {problems}") from None


class DeviceCluster(BaseModel):
    """``nodes`` x ``devices_per_node`` identical devices."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    device: DeviceProfile

    @property
    def num_devices(self) -> int:
        """All devices of the cluster (the ``N`` of Algorithm 1)."""
        return self.nodes * self.devices_per_node

    def intra_bandwidth(self) -> float:
        """Achievable bytes/s per device inside a node."""
        return self.device.intra_node_bandwidth_gbs * GB * self.device.comm_efficiency

    def inter_bandwidth(self) -> float:
        """Achievable bytes/s per device across nodes: the node's NIC shared by its devices."""
        node = self.device.inter_node_bandwidth_gbs * GB * self.device.comm_efficiency
        return node / self.devices_per_node

    def group_bandwidth(self, span: int) -> float:
        """Bandwidth of a collective whose ranks sit in a contiguous block of ``span`` devices:
        NVLink when the block fits in a node, the shared network otherwise."""
        return self.intra_bandwidth() if span <= self.devices_per_node else self.inter_bandwidth()


def make_cluster(
    nodes: int,
    devices_per_node: int,
    device: str | DeviceProfile = "a100-80g",
    overrides: Mapping[str, Any] | None = None,
    profile: str | Path | Mapping[str, Any] | None = None,
) -> DeviceCluster:
    """Convenience constructor: a named device with optional overrides and calibration."""
    return DeviceCluster(
        nodes=nodes,
        devices_per_node=devices_per_node,
        device=device_profile(device, overrides, profile),
    )
