"""What the engine reads from the model folder besides the weights and core's stop/pad ids.

(The folder check and the EOS / pad resolution are core's: :mod:`hf_core.engines.hf_folder`.)
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: Path) -> bool:
    """Whether vLLM can load a tokenizer from the folder (it needs none to generate from ids,
    but without one its start-up chat-template warm-up logs a scary traceback)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)
