"""Tokenised prompt datasets and their collation into a :class:`~hf_core.batch.Batch`.

A record is a mapping with a prompt field (``prompt_key``; a raw string or a chat ``messages``
list of ``{"role": ..., "content": ...}``), an optional ground truth (``ground_truth_key``) and
any other fields, which travel with the sample as per-sample non-tensors.  Both keys may be
dotted paths into nested records (``"reward_model.ground_truth"``, the verl parquet format); an
exact top-level key wins over the dotted reading.

All prompts are tokenised once, when the dataset is built, so over-long prompts are dropped up
front (counted and logged) and every batch of the loader has exactly the size asked for.

Tokenisation: with the chat template (the default when the tokenizer has one), a string prompt
becomes ``[{"role": "user", "content": prompt}]`` and is rendered with
``apply_chat_template(add_generation_prompt=True, tokenize=False)``, then tokenised without
adding special tokens again; without it the raw string is tokenised with the tokenizer's
default special tokens (e.g. a BOS).  A chat ``messages`` prompt needs the chat template.

Collation left-pads to the longest prompt of the batch and gives tensors ``input_ids`` and
``attention_mask`` ([B, T], int64) and ``position_ids`` (0 on padding, then 0, 1, 2, ...), and
non-tensors ``raw_prompt`` (the record's prompt value as read), ``ground_truth`` (``None`` when a
record has none), ``sample_index`` (the record's 0-based position across the input files) and
each extra field (``None`` where a record lacks it).

Images (vision-language models): given a :class:`~hf_core.multimodal.VisionProcessor`, a
record's ``image_key`` field (one image or a list: paths relative to the data file, bytes,
data URLs, ``{bytes, path}`` mappings) is decoded and checked when the dataset is built, each
``<image>`` of the prompt becomes the model's image tokens, expanded to the image's size, and
collation adds the non-tensors ``multi_modal_inputs`` (pixel patches and grid sizes per
sample) and ``images`` (the decoded images).  Every image problem is a
:class:`~hf_core.errors.DataError` naming the record.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_core.batch import Batch
from hf_core.data.io import DataError, RecordLocation, read_records
from hf_core.multimodal import IMAGES_KEY, MULTI_MODAL_KEY, VisionProcessor

logger = logging.getLogger("hf_core.data")

#: Batch keys the dataset writes itself; a record field with one of these names is an error.
RESERVED_KEYS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "raw_prompt",
        "ground_truth",
        "sample_index",
        MULTI_MODAL_KEY,
    }
)
_MISSING = object()
_TOKENIZE_CHUNK = 1024


@dataclass(frozen=True)
class PromptItem:
    """One tokenised prompt with what travels beside it."""

    input_ids: list[int]
    raw_prompt: Any
    ground_truth: Any
    sample_index: int
    extras: dict[str, Any] = field(default_factory=dict)
    images: tuple[Any, ...] = ()
    """The record's image values as read (decoded again at collation, so a dataset of
    images does not hold every decoded image in memory)."""
    image_base: Path | None = None
    """The folder relative image paths resolve against (the data file's)."""
    where: str = ""


def _lookup(record: Mapping[str, Any], key: str) -> Any:
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _object_array(values: Sequence[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


class PromptDataset:
    """Prompts tokenised once, filtered by length, addressable by index.

    Args:
        records: mappings, one per prompt (see the module doc for the fields).
        tokenizer: a Hugging Face tokenizer (anything with ``__call__``, ``pad_token_id`` and,
            for chat prompts, ``apply_chat_template``).
        prompt_key: the field holding the prompt (string or chat messages).
        ground_truth_key: the field holding the reference answer (optional per record).
        extra_keys: the other fields to carry as non-tensors; ``None`` carries every field
            except the prompt and ground-truth keys.
        max_prompt_length: prompts with more tokens are dropped (``None``: keep all).
        chat_template: ``True`` renders prompts with the tokenizer's chat template, ``False``
            tokenises the raw string, ``None`` uses the template when the tokenizer has one.
        locations: where each record came from (for error messages); set by :meth:`from_files`.
        vision: the vision-language model's processor; records' ``image_key`` images are
            loaded, checked and expanded into image tokens (see the module doc).
        image_key: the field holding a record's image or list of images.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        ground_truth_key: str = "ground_truth",
        extra_keys: Sequence[str] | None = None,
        max_prompt_length: int | None = None,
        chat_template: bool | None = None,
        locations: Sequence[RecordLocation] | None = None,
        name: str = "<records>",
        vision: VisionProcessor | None = None,
        image_key: str = "images",
    ) -> None:
        if max_prompt_length is not None and max_prompt_length < 1:
            raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if locations is not None and len(locations) != len(records):
            raise DataError(f"{len(locations)} locations for {len(records)} records")
        self.name = name
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.ground_truth_key = ground_truth_key
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = self._pad_id(tokenizer)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template is None:
            chat_template = has_template
        elif chat_template and not has_template:
            raise DataError(f"{name}: chat_template=True but the tokenizer has no chat template")
        self.chat_template = chat_template
        self.vision = vision

        def where(i: int) -> str:
            return str(locations[i]) if locations is not None else f"{name}: record {i}"

        skip = {prompt_key, prompt_key.split(".")[0], ground_truth_key, image_key}
        if extra_keys is None:
            keys: list[str] = []
            for record in records:
                keys += [k for k in record if k not in skip and k not in keys]
        else:
            keys = list(extra_keys)
        clash = sorted(set(keys) & RESERVED_KEYS)
        if clash:
            raise DataError(
                f"{name}: record field(s) {clash} clash with batch keys the loader writes; "
                "rename them or set extra_keys"
            )
        self.extra_keys = keys

        prompts, ground_truths, extras, images = [], [], [], []
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise DataError(f"{where(i)}: expected a mapping, got {type(record).__name__}")
            prompt = _lookup(record, prompt_key)
            if prompt is _MISSING:
                raise DataError(
                    f"{where(i)}: missing prompt key {prompt_key!r}; "
                    f"the record has keys {sorted(record)}: set prompt_key "
                    "(data.prompt_key in a recipe) to the field holding the prompt"
                )
            if isinstance(prompt, str):
                pass
            elif _is_messages(prompt):
                if not chat_template:
                    raise DataError(
                        f"{where(i)}: prompt {prompt_key!r} is a chat messages list, which needs "
                        "a tokenizer with a chat template (or chat_template=True)"
                    )
            else:
                raise DataError(
                    f"{where(i)}: prompt {prompt_key!r} must be a string or a list of chat "
                    f"messages with 'role' and 'content', got {type(prompt).__name__}: "
                    f"{_short(prompt)}"
                )
            truth = _lookup(record, ground_truth_key)
            prompts.append(prompt)
            ground_truths.append(None if truth is _MISSING else truth)
            extras.append({k: record.get(k) for k in keys})
            images.append(self._images(record, image_key, where(i)))

        token_ids = self._tokenize(prompts)
        self.num_records = len(prompts)
        self.items: list[PromptItem] = []
        longest_dropped = 0
        for i, ids in enumerate(token_ids):
            if not ids:
                raise DataError(f"{where(i)}: prompt {prompt_key!r} tokenises to no tokens")
            base = locations[i].path.parent if locations is not None else None
            if vision is not None:
                decoded = vision.load(images[i], where(i), base)
                ids = vision.expand(ids, vision.encode(decoded, where(i)), where(i))
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                longest_dropped = max(longest_dropped, len(ids))
                continue
            self.items.append(
                PromptItem(
                    ids, prompts[i], ground_truths[i], i, extras[i], images[i], base, where(i)
                )
            )
        self.num_filtered = self.num_records - len(self.items)
        if self.num_filtered:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens "
                "(longest dropped: %d tokens)",
                name,
                self.num_filtered,
                self.num_records,
                max_prompt_length,
                longest_dropped,
            )
        if not self.items:
            raise DataError(
                f"{name}: no prompts left"
                + (
                    f" (all {self.num_records} exceed max_prompt_length={max_prompt_length})"
                    if self.num_records
                    else " (the dataset is empty)"
                )
            )
        self._fingerprint: str | None = None

    # ---------------------------------------------------------------- building
    @classmethod
    def from_files(
        cls,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        tokenizer: Any,
        **kwargs: Any,
    ) -> PromptDataset:
        """Read JSONL / JSON / Parquet file(s) and build the dataset (see the class doc)."""
        located = read_records(paths)
        records = [r for r, _ in located]
        locations = [loc for _, loc in located]
        if isinstance(paths, str | os.PathLike):
            name = str(paths)
        else:
            names = [str(p) for p in paths]
            name = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more)"
        return cls(records, tokenizer, locations=locations, name=name, **kwargs)

    def _images(self, record: Mapping[str, Any], key: str, where: str) -> tuple[Any, ...]:
        value = _lookup(record, key)
        if value is _MISSING or value is None:
            return ()
        values = tuple(value) if isinstance(value, list | tuple) else (value,)
        if values and self.vision is None:
            raise DataError(
                f"{where}: the record has images ({key!r}) but the model is not a "
                "vision-language model"
            )
        return values

    @staticmethod
    def _pad_id(tokenizer: Any) -> int:
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int):
                return value
        raise DataError("the tokenizer has neither a pad token nor an EOS token to pad with")

    def _render(self, prompt: Any) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )

    def _tokenize(self, prompts: list[Any]) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(prompts), _TOKENIZE_CHUNK):
            chunk = prompts[start : start + _TOKENIZE_CHUNK]
            vision = self.vision
            if self.chat_template:
                texts = [self._render(p) for p in chunk]
                if vision is not None:
                    texts = [vision.render(text) for text in texts]
                encoded = self.tokenizer(texts, add_special_tokens=False)
            else:
                if vision is not None:
                    chunk = [vision.render(text) for text in chunk]
                encoded = self.tokenizer(chunk)
            out += [list(ids) for ids in encoded["input_ids"]]
        return out

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    @property
    def fingerprint(self) -> str:
        """A hash of every kept prompt's token ids: changes if the data, tokenizer or filter do."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for item in self.items:
                digest.update(np.asarray(item.input_ids, dtype=np.int64).tobytes())
                digest.update(b"|")
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def collate(self, indices: Sequence[int]) -> Batch:
        """The prompts at ``indices`` (positions in this dataset) as one left-padded batch."""
        items = [self.items[int(i)] for i in indices]
        if not items:
            raise DataError("cannot collate an empty list of prompts")
        width = max(len(item.input_ids) for item in items)
        input_ids = torch.full((len(items), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item.input_ids)
            input_ids[row, width - n :] = torch.tensor(item.input_ids, dtype=torch.long)
            attention_mask[row, width - n :] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        non_tensors = {
            "raw_prompt": _object_array([item.raw_prompt for item in items]),
            "ground_truth": _object_array([item.ground_truth for item in items]),
            "sample_index": _object_array([item.sample_index for item in items]),
        }
        for key in self.extra_keys:
            non_tensors[key] = _object_array([item.extras.get(key) for item in items])
        if self.vision is not None:
            decoded = [self.vision.load(item.images, item.where, item.image_base) for item in items]
            features = [
                self.vision.encode(images, item.where)
                for images, item in zip(decoded, items, strict=True)
            ]
            non_tensors[MULTI_MODAL_KEY] = _object_array(features)
            non_tensors[IMAGES_KEY] = _object_array(decoded)
        return Batch(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            non_tensors,
        )

    def __repr__(self) -> str:
        return (
            f"PromptDataset({self.name!r}, {len(self)} prompts, {self.num_filtered} filtered, "
            f"chat_template={self.chat_template})"
        )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
