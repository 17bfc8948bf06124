"""The batch that flows between the controller and the workers.

A :class:`Batch` holds three things that travel together:

* ``tensors`` - a :class:`tensordict.TensorDict` whose entries share the leading batch
  dimension (token ids, masks, log-probs, values, ...);
* ``non_tensors`` - per-sample Python values (raw prompts, ground truths, data sources) kept as
  1-D numpy object arrays so they index, split and concatenate like the tensors;
* ``meta`` - batch-wide values (temperature, step, ...).

Every operation checks batch sizes and key clashes and raises :class:`BatchError` naming the
offending key, so a shape bug surfaces where it happens rather than three stages later.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


class BatchError(ValueError):
    """A batch operation got inconsistent sizes or clashing keys."""


def _as_object_array(values: Sequence[Any] | np.ndarray, key: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise BatchError(f"non-tensor {key!r} must be 1-D, got shape {values.shape}")
        return values.astype(object, copy=False)
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))
    return bool(a == b)


class Batch:
    """Tensors sharing a batch dimension, per-sample Python values and batch-wide meta."""

    __slots__ = ("meta", "non_tensors", "tensors")

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
        batch_size: int | None = None,
    ) -> None:
        tensor_map = dict(tensors.items()) if tensors is not None else {}
        array_map = {k: _as_object_array(v, k) for k, v in (non_tensors or {}).items()}
        size = batch_size
        entries: Mapping[str, torch.Tensor | np.ndarray]
        for kind, entries in (("tensor", tensor_map), ("non-tensor", array_map)):
            for key, value in entries.items():
                if value.ndim == 0:
                    raise BatchError(f"{kind} {key!r} is a scalar; put batch-wide values in meta")
                if size is None:
                    size = int(value.shape[0])
                elif int(value.shape[0]) != size:
                    raise BatchError(
                        f"{kind} {key!r} has batch size {int(value.shape[0])}, expected {size}"
                    )
        clash = set(tensor_map) & set(array_map)
        if clash:
            raise BatchError(f"keys {sorted(clash)} are both tensor and non-tensor")
        self.tensors = TensorDict(tensor_map, batch_size=[size or 0])
        self.non_tensors: dict[str, np.ndarray] = array_map
        self.meta: dict[str, Any] = dict(meta or {})

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        return [*self.tensors.keys(), *self.non_tensors.keys()]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors.keys() or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        if key in self.non_tensors:
            return self.non_tensors[key]
        if key in self.tensors.keys():
            return self.tensors[key]
        raise KeyError(f"batch has no key {key!r}; it has {sorted(self.keys())}")

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any] | np.ndarray) -> None:
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != len(self):
                raise BatchError(
                    f"tensor {key!r} has shape {tuple(value.shape)}, "
                    f"expected leading dimension {len(self)}"
                )
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
            return
        array = _as_object_array(value, key)
        if len(array) != len(self):
            raise BatchError(f"non-tensor {key!r} has {len(array)} values, expected {len(self)}")
        if key in self.tensors.keys():
            del self.tensors[key]
        self.non_tensors[key] = array

    def pop(self, key: str) -> torch.Tensor | np.ndarray:
        value = self[key]
        if key in self.non_tensors:
            del self.non_tensors[key]
        else:
            del self.tensors[key]
        return value

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        fields += [f"{k}: object" for k in self.non_tensors]
        return f"Batch(size={len(self)}, {{{', '.join(fields)}}}, meta={sorted(self.meta)})"

    # -------------------------------------------------------------- selection
    def _replace(self, tensors: TensorDict, non_tensors: dict[str, np.ndarray]) -> Batch:
        out = Batch.__new__(Batch)
        out.tensors = tensors
        out.non_tensors = non_tensors
        out.meta = dict(self.meta)
        return out

    def select(self, *keys: str, meta_keys: Iterable[str] | None = None) -> Batch:
        """A batch with only ``keys`` (and only ``meta_keys`` of meta, or all of it)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no keys {missing}; it has {sorted(self.keys())}")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]
        out = self._replace(
            self.tensors.select(*tensor_keys),
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
        )
        if meta_keys is not None:
            out.meta = {k: self.meta[k] for k in meta_keys}
        return out

    def index(self, indices: slice | Sequence[int] | torch.Tensor | np.ndarray) -> Batch:
        """The samples at ``indices`` (a slice, integer list or boolean mask)."""
        if isinstance(indices, slice):
            np_index: slice | np.ndarray = indices
            torch_index: slice | torch.Tensor = indices
        else:
            torch_index = torch.as_tensor(np.asarray(indices))
            if torch_index.dtype == torch.bool and torch_index.shape[0] != len(self):
                raise BatchError(f"mask has {torch_index.shape[0]} entries, batch has {len(self)}")
            np_index = torch_index.numpy()
        return self._replace(
            self.tensors[torch_index], {k: v[np_index] for k, v in self.non_tensors.items()}
        )

    # -------------------------------------------------------- split / concat
    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` samples (the last may be shorter)."""
        if size <= 0:
            raise BatchError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, chunks: int) -> list[Batch]:
        """``chunks`` equal pieces; the batch size must divide evenly (pad first if not)."""
        if chunks <= 0:
            raise BatchError(f"chunk count must be positive, got {chunks}")
        if len(self) % chunks:
            raise BatchError(
                f"batch of {len(self)} does not split into {chunks} equal chunks; "
                f"use pad_to_multiple({chunks}) first"
            )
        return self.split(len(self) // chunks) if len(self) else [self] * chunks

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches along the batch dimension; keys and meta must agree."""
        if not batches:
            raise BatchError("concat needs at least one batch")
        first = batches[0]
        tensor_keys, other_keys = set(first.tensors.keys()), set(first.non_tensors)
        meta = dict(first.meta)
        for i, batch in enumerate(batches[1:], start=1):
            if set(batch.tensors.keys()) != tensor_keys or set(batch.non_tensors) != other_keys:
                raise BatchError(
                    f"batch {i} has keys {sorted(batch.keys())}, batch 0 has {sorted(first.keys())}"
                )
            for key, value in batch.meta.items():
                if key in meta and not _values_equal(meta[key], value):
                    raise BatchError(f"meta {key!r} differs between batch 0 and batch {i}")
                meta[key] = value
        tensors = torch.cat([b.tensors for b in batches]) if tensor_keys else None
        total = sum(len(b) for b in batches)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in other_keys}
        out = Batch(non_tensors=non_tensors, meta=meta, batch_size=total)
        if tensors is not None:
            out.tensors = tensors
        return out

    def union(self, other: Batch) -> Batch:
        """Merge another batch's keys into a copy of this one.

        Both must have the same size; a key present in both must hold equal values (a clash is
        an error rather than a silent overwrite).
        """
        if len(other) != len(self):
            raise BatchError(f"cannot union batches of size {len(self)} and {len(other)}")
        out = self._replace(self.tensors.clone(recurse=False), dict(self.non_tensors))
        for key in other.keys():
            value = other[key]
            if key in self and not _values_equal(self[key], value):
                raise BatchError(f"union: key {key!r} differs between the two batches")
            out[key] = value
        for key, value in other.meta.items():
            if key in out.meta and not _values_equal(out.meta[key], value):
                raise BatchError(f"union: meta {key!r} differs between the two batches")
            out.meta[key] = value
        return out

    def __or__(self, other: Batch) -> Batch:
        return self.union(other)

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each sample ``repeats`` times in a row (a GRPO group is consecutive samples)."""
        if repeats < 1:
            raise BatchError(f"repeats must be >= 1, got {repeats}")
        index = torch.arange(len(self)).repeat_interleave(repeats)
        return self.index(index)

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Pad by repeating leading samples so the size divides ``multiple``; returns the pad.

        Padding reuses real samples (not zeros) so padded rows stay valid model inputs.
        """
        if multiple < 1:
            raise BatchError(f"multiple must be >= 1, got {multiple}")
        if len(self) == 0:
            raise BatchError("cannot pad an empty batch")
        pad = -len(self) % multiple
        if pad == 0:
            return self, 0
        index = torch.cat([torch.arange(len(self)), torch.arange(pad) % len(self)])
        return self.index(index), pad

    def unpad(self, pad: int) -> Batch:
        """Drop the ``pad`` trailing samples :meth:`pad_to_multiple` added."""
        if pad < 0 or pad > len(self):
            raise BatchError(f"cannot unpad {pad} samples from a batch of {len(self)}")
        return self if pad == 0 else self.index(slice(0, len(self) - pad))

    def to(self, device: torch.device | str) -> Batch:
        return self._replace(self.tensors.to(device), dict(self.non_tensors))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    # ------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # A plain dict of tensors pickles faster than a TensorDict and keeps Ray's
        # zero-copy path for tensor buffers.
        return {
            "tensors": dict(self.tensors.items()),
            "size": len(self),
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = TensorDict(state["tensors"], batch_size=[state["size"]])
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]
