"""Datasets: local JSONL / JSON / Parquet files -> tokenised, left-padded batches (prompts
for RL; :class:`SFTDataset` / :class:`PreferenceDataset` for the supervised and preference
trainers, :mod:`hf_core.data.chat_tokens`).

    dataset = PromptDataset.from_files("train.jsonl", tokenizer, max_prompt_length=256)
    loader = PromptLoader(dataset, batch_size=32, shuffle=True, seed=0, num_epochs=None)
    for batch in loader:          # Batch: input_ids, attention_mask, position_ids,
        ...                       #        raw_prompt, ground_truth, sample_index, extras
    checkpoint["data"] = loader.state_dict()      # later: loader.load_state_dict(...)

    val = PromptLoader.for_validation(PromptDataset.from_files("val.jsonl", tokenizer), 64)

The datasets and loaders import torch, numpy and :mod:`hf_core.batch` (pyarrow lazily, for
Parquet); this package imports each module on first use, so :mod:`hf_core.data.io` (file checks,
JSONL) and the ``prepare`` command load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_core.lazy_imports import lazy_package

if TYPE_CHECKING:
    from hf_core.data.chat_tokens import PreferenceDataset as PreferenceDataset
    from hf_core.data.chat_tokens import SFTDataset as SFTDataset
    from hf_core.data.dataset import RESERVED_KEYS as RESERVED_KEYS
    from hf_core.data.dataset import PromptDataset as PromptDataset
    from hf_core.data.dataset import PromptItem as PromptItem
    from hf_core.data.io import DataError as DataError
    from hf_core.data.io import RecordLocation as RecordLocation
    from hf_core.data.io import check_dataset_file as check_dataset_file
    from hf_core.data.io import read_records as read_records
    from hf_core.data.io import write_jsonl as write_jsonl
    from hf_core.data.loader import CollatingDataset as CollatingDataset
    from hf_core.data.loader import PromptLoader as PromptLoader
# The re-exports above; the typed ones load on first use (hf_core.lazy_imports).
__all__, __getattr__, __dir__ = lazy_package(__name__)
