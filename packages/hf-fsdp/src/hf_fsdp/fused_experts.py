"""Expert weights of transformers MoE models: fused in the module, one tensor per expert in
the canonical (checkpoint) names.

transformers (5.x) holds a layer's experts as two 3-D parameters, ``experts.gate_up_proj``
``[experts, 2 x intermediate, hidden]`` (each expert's gate rows, then its up rows) and
``experts.down_proj`` ``[experts, hidden, intermediate]``, and converts from and to the
checkpoint's per-expert tensors when it loads and saves.  The canonical names every backend
exchanges in a weight sync are the checkpoint's (vLLM and SGLang load those), so this
module names the per-expert slices of a fused tensor: :func:`expert_slices` gives views,
which an export sends and a rollout engine copies into in place (no fused copy is built).
``tests/test_moe_weights.py`` checks the layout against transformers' own conversion.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from hf_core.errors import EngineConfigError


class ExpertNames(NamedTuple):
    """A family's checkpoint names for one expert's three projections, and where its
    experts sit under the decoder layer."""

    experts: str
    gate: str
    up: str
    down: str


FAMILIES: dict[str, ExpertNames] = {
    "qwen2_moe": ExpertNames("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ExpertNames("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ExpertNames("block_sparse_moe.experts", "w1", "w3", "w2"),
}
"""model_type -> checkpoint names (transformers' ``conversion_mapping`` for these types)."""

_FUSED = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")


def expert_names(model_type: str) -> ExpertNames:
    """The checkpoint names of ``model_type``'s experts; a clear error for an MoE family
    whose mapping is not written yet."""
    names = FAMILIES.get(model_type)
    if names is None:
        raise EngineConfigError(
            f"mixture-of-experts model type {model_type!r}: its expert weights have no "
            f"mapping to canonical names yet (mapped: {', '.join(sorted(FAMILIES))})"
        )
    return names


def is_fused(name: str) -> bool:
    """Whether ``name`` is a fused expert parameter."""
    return _FUSED.match(name) is not None


def expert_slices(
    name: str, tensor: torch.Tensor, names: ExpertNames, first: int = 0
) -> list[tuple[str, torch.Tensor]] | None:
    """``(canonical name, view)`` per expert projection of the fused parameter ``name``
    (``None`` when ``name`` is not one).  ``tensor`` may be a run of experts from expert
    ``first`` on (a rank's dim-0 shard)."""
    match = _FUSED.match(name)
    if match is None:
        return None
    layer = match["layer"]
    base = f"{layer}.{names.experts}"
    out = []
    if match["which"] == "down_proj":
        for e in range(tensor.shape[0]):
            out.append((f"{base}.{first + e}.{names.down}.weight", tensor[e]))
        return out
    half = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        out.append((f"{base}.{first + e}.{names.gate}.weight", tensor[e, :half]))
        out.append((f"{base}.{first + e}.{names.up}.weight", tensor[e, half:]))
    return out
