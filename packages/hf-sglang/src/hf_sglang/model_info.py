"""What the engine reads from the model folder besides the weights: stop and pad ids.

Resolved exactly as the HF rollout engine does (generation_config.json first, then
config.json), so both engines stop on the same tokens and pad responses with the same id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


def check_model_folder(path: str | Path) -> Path:
    """The folder as a Path, or a :class:`FileNotFoundError` saying what is missing."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist (or is not a folder)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {folder} has no config.json (is it a HuggingFace model folder?)"
        )
    return folder


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class SpecialTokens:
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def special_tokens(folder: Path) -> SpecialTokens:
    """EOS ids and the pad id the HF rollout engine would use for this folder."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    eos = _as_list(gen.eos_token_id) or _as_list(getattr(config, "eos_token_id", None))
    pad = gen.pad_token_id
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    return SpecialTokens(tuple(eos), int(pad if pad is not None else (eos or [0])[0]))
