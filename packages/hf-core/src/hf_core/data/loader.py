"""A resumable iterator of prompt batches.

Order: epoch ``e`` visits the dataset in the permutation drawn from
``numpy.random.Generator(PCG64(SeedSequence([seed, e])))`` (the identity when
``shuffle=False``).  The order of an epoch is a pure function of ``(seed, epoch, len(dataset))``,
so the loader's whole position is ``(epoch, offset)``: there is no hidden RNG state to lose.
:meth:`PromptLoader.state_dict` also records the seed, the dataset's fingerprint and a digest of
the current epoch's order, and :meth:`PromptLoader.load_state_dict` refuses (``strict=True``) to
resume onto different data or an environment that would shuffle differently, rather than
silently feeding other batches.

Batches never span epochs.  ``drop_last=True`` (the training default): each epoch yields
``len(dataset) // batch_size`` full batches and the remaining ``len(dataset) % batch_size``
prompts of that epoch's order are skipped (a different remainder each epoch when shuffling).
``drop_last=False``: the last batch of an epoch holds the remainder and may be smaller.

``num_epochs=None`` iterates forever (the trainer stops after its step budget).  A training
loader is its own iterator: ``for batch in loader`` continues from the saved position.  A
``single_pass`` loader (see :meth:`PromptLoader.for_validation`) restarts from its first batch
every time it is iterated, in dataset order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hf_core.batch import Batch
from hf_core.data.io import DataError

_STATE_VERSION = 1


class CollatingDataset(Protocol):
    """What the loader reads: a named dataset of examples collated into batches by position
    (:class:`~hf_core.data.PromptDataset`, the SFT and preference datasets of
    :mod:`hf_core.data.chat_tokens`); its fingerprint ties a saved position to its content."""

    name: str

    @property
    def fingerprint(self) -> str: ...

    def __len__(self) -> int: ...

    def collate(self, indices: Sequence[int]) -> Batch: ...


class PromptLoader:
    """Batches of ``batch_size`` prompts from a :class:`PromptDataset`, resumable exactly.

    Args:
        dataset: the tokenised prompts.
        batch_size: prompts per batch (before any ``n`` samples per prompt).
        shuffle: visit each epoch in a seeded random order.
        seed: the shuffle seed.
        drop_last: skip each epoch's incomplete final batch (see the module doc).
        num_epochs: passes over the data; ``None`` for an endless stream.
        single_pass: every ``iter()`` starts a fresh pass from the start (validation);
            forces ``num_epochs=1``.
    """

    def __init__(
        self,
        dataset: CollatingDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_epochs: int | None = 1,
        single_pass: bool = False,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise DataError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        if drop_last and len(dataset) < batch_size:
            raise DataError(
                f"{dataset.name}: {len(dataset)} prompts cannot fill one batch of {batch_size} "
                "with drop_last=True; lower batch_size or set drop_last=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.single_pass = single_pass
        self.num_epochs = 1 if single_pass else num_epochs
        self._epoch = 0
        self._offset = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def for_validation(cls, dataset: CollatingDataset, batch_size: int) -> PromptLoader:
        """One pass in dataset order, every prompt once, the last batch possibly smaller."""
        return cls(
            dataset, batch_size, shuffle=False, drop_last=False, num_epochs=1, single_pass=True
        )

    # ------------------------------------------------------------------ order
    def order(self, epoch: int) -> np.ndarray:
        """The dataset indices in the order epoch ``epoch`` visits them."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = len(self.dataset)
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            order = rng.permutation(n)
        else:
            order = np.arange(n)
        self._order_cache = (epoch, order)
        return order

    def _order_digest(self, epoch: int) -> str:
        return hashlib.sha256(self.order(epoch).astype(np.int64).tobytes()).hexdigest()[:16]

    # -------------------------------------------------------------- iteration
    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def total_batches(self) -> int | None:
        """Batches over all epochs (``None`` for an endless loader)."""
        return None if self.num_epochs is None else self.num_epochs * len(self)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_done(self) -> int:
        """Batches yielded since the start (across epochs)."""
        return self._epoch * len(self) + -(-self._offset // self.batch_size)

    def exhausted(self) -> bool:
        return self.num_epochs is not None and self._epoch >= self.num_epochs

    def reset(self) -> PromptLoader:
        """Back to the first batch of epoch 0."""
        self._epoch, self._offset = 0, 0
        return self

    def __iter__(self) -> PromptLoader:
        if self.single_pass:
            self.reset()
        return self

    def __next__(self) -> Batch:
        if self.exhausted():
            raise StopIteration
        n = len(self.dataset)
        start = self._offset
        end = min(start + self.batch_size, n)
        indices = self.order(self._epoch)[start:end]
        self._offset = end
        remaining = n - end
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self._epoch, self._offset = self._epoch + 1, 0
        return self.dataset.collate(indices)

    # ------------------------------------------------------------- resumption
    def state_dict(self) -> dict[str, Any]:
        """The position (plain Python values, fit for a checkpoint)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "offset": self._offset,
            **self._identity(),
            "order_digest": self._order_digest(self._epoch),
        }

    def _identity(self) -> dict[str, Any]:
        """What must match for a saved position to mean the same batches on resume."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "num_samples": len(self.dataset),
            "dataset_fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Resume at the position in ``state``; the next batch is the one that came next.

        With ``strict=True`` (the default) a state from a loader with another seed, shuffle
        setting, drop_last, batch size, dataset content or shuffle implementation is an error
        naming what differs; ``strict=False`` only takes the epoch and offset.
        """
        if state.get("version") != _STATE_VERSION:
            raise DataError(f"unsupported PromptLoader state version {state.get('version')!r}")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if strict:
            expected = self._identity()
            diffs = [
                f"{key}: saved {state.get(key)!r}, now {value!r}"
                for key, value in expected.items()
                if state.get(key) != value
            ]
            if not diffs and state.get("order_digest") != self._order_digest(epoch):
                diffs.append(f"the order of epoch {epoch} differs (numpy's shuffle changed?)")
            if diffs:
                raise DataError(
                    "cannot resume the prompt loader exactly: "
                    + "; ".join(diffs)
                    + " (load_state_dict(..., strict=False) resumes at the same position anyway)"
                )
        if not 0 <= offset <= len(self.dataset) or epoch < 0:
            raise DataError(f"invalid loader position epoch={epoch}, offset={offset}")
        self._epoch, self._offset = epoch, offset

    def __repr__(self) -> str:
        return (
            f"PromptLoader({len(self.dataset)} prompts, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
            f"epoch={self._epoch}, offset={self._offset})"
        )
