"""Pooled CPU training's pure parts (hf_fsdp.cpu_host_training, hf_fsdp.cpu_host): when the
ranks' batches join into one, and the threads of the leader's work alone.  The training itself
is checked against one process in test_fsdp_dp2.py."""

from __future__ import annotations

import torch

from hf_core.batch import Batch
from hf_fsdp.cpu_host import HostPool, split_rows
from hf_fsdp.cpu_host_training import joined


def test_batches_of_one_width_join_in_rank_order_and_split_back() -> None:
    first = Batch({"input_ids": torch.arange(6).view(2, 3)})
    second = Batch({"input_ids": torch.arange(6, 15).view(3, 3)})
    whole = joined([first, second])
    assert whole is not None and whole["input_ids"][:, 0].tolist() == [0, 3, 6, 9, 12]
    back = split_rows(whole, [2, 3])
    assert torch.equal(back[1]["input_ids"], second["input_ids"])
    wider = Batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert joined([first, wider]) is None  # widths differ: each rank's share on its own


def test_work_the_other_ranks_wait_for_runs_on_the_pools_threads() -> None:
    pool = HostPool.__new__(HostPool)  # no process group needed for the threads
    pool.threads = 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        produced = (torch.get_num_threads() for _ in range(3))
        seen = [(made, torch.get_num_threads()) for made in pool.while_others_wait(produced)]
        assert seen == [(2, 2)] * 3  # the producer's steps and the consumer's between them
        assert torch.get_num_threads() == 1  # the rank's own count once the items end
    finally:
        torch.set_num_threads(before)
