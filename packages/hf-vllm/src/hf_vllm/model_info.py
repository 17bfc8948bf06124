"""What the engine reads from the model folder besides the weights and core's stop/pad ids.

(The folder check and the EOS / pad resolution are core's: :mod:`hf_core.engines.hf_folder`.)
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""config.json keys that state a model's longest sequence (vLLM reads the same ones)"""


def has_tokenizer(folder: Path) -> bool:
    """Whether vLLM can load a tokenizer from the folder (it needs none to generate from ids,
    but without one its start-up chat-template warm-up logs a scary traceback)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def max_positions(folder: Path) -> int | None:
    """The longest sequence the model's ``config.json`` states (a multimodal model's text
    config first), which vLLM's ``max_model_len`` defaults to; None if it states none."""
    config = json.loads((folder / "config.json").read_text())
    for section in (config.get("text_config") or {}, config):
        for key in POSITION_KEYS:
            if isinstance(section.get(key), int):
                return int(section[key])
    return None
