"""TEST-ONLY stand-in for ``sgl_kernel`` (the ``sglang-kernel`` wheel), CPU path only.

Why it exists: the package registry has no CPU build of ``sglang-kernel``, and SGLang 0.5.23's
CPU engine (``SGLANG_USE_CPU_ENGINE=1``) calls one of its ops on the generation path,
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``).  This pure-torch
version has the semantics of SGLang's Triton kernel ``assign_req_to_token_pool``: for request
``i`` it writes the next ``end - start`` entries of ``out_cache_loc`` (the requests' slices,
concatenated in order) into row ``req_pool_indices[i]`` of ``req_to_token``, columns
``start_offset[i]:end_offset[i]``.

SGLang also imports a few more ``*_cpu`` ops at import time, for features the tests never use
(speculative decoding, KV moves between slots); they exist here so the import succeeds and
raise if ever called.  This module never ships to users.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

IS_HF_SGLANG_TEST_STAND_IN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[cursor:cursor + end - start]`` per request."""
    del pool_len  # the row length of req_to_token; implied by the tensor here
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        length = end - start
        values = out_cache_loc[cursor : cursor + length]
        req_to_token[row, start:end] = values.to(req_to_token.dtype)
        cursor += length


def _not_on_tested_path(name: str) -> Callable[..., None]:
    """A name SGLang imports at import time but only calls on paths the tests never take."""

    def unavailable(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by hf-sglang's CPU test stand-in (only "
            "assign_req_to_token_pool_cpu is); this SGLang feature is not covered on CPU"
        )

    unavailable.__name__ = name
    return unavailable


# KV-cache moves between slots (speculative decoding / disaggregation).
copy_all_layer_kv_cache_cpu = _not_on_tested_path("copy_all_layer_kv_cache_cpu")
# Speculative decoding (EAGLE trees, draft cache locations).
build_tree_kernel_efficient_cpu = _not_on_tested_path("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _not_on_tested_path("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_on_tested_path(
    "assign_draft_cache_locs_contiguous_cpu"
)
assign_extend_cache_locs_cpu = _not_on_tested_path("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _not_on_tested_path("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_on_tested_path("fill_bonus_tokens_cpu")
