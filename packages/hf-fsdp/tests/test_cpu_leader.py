"""Leader CPU training's pure parts (hf_fsdp.data_parallel.cpu_leader, hf_fsdp.cpu_leader):
when the ranks' batches join into one.  The training itself is checked against one process
in test_fsdp_dp2.py and against FSDP2 in test_data_parallel_equality.py."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_fsdp.cpu_leader import split_rows
from hf_fsdp.data_parallel.cpu_leader import joined


def test_batches_of_one_width_join_in_rank_order_and_split_back() -> None:
    first = Batch({"input_ids": torch.arange(6).view(2, 3)})
    second = Batch({"input_ids": torch.arange(6, 15).view(3, 3)})
    whole = joined([first, second])
    assert whole is not None and whole["input_ids"][:, 0].tolist() == [0, 3, 6, 9, 12]
    back = split_rows(whole, [2, 3])
    assert torch.equal(back[1]["input_ids"], second["input_ids"])
    wider = Batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert joined([first, wider]) is None  # widths differ: each rank's share on its own
