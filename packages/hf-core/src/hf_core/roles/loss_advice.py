"""Which aggregation a policy loss is defined with, and the warning when a recipe differs.

Apart from :mod:`hf_core.roles.losses` (torch) so the pre-start checks can warn without
importing torch; that module re-exports both names.
"""

from __future__ import annotations

from hf_core.config import AlgorithmConfig

RECOMMENDED_LOSS_AGG_MODE = {
    "gspo": "seq-mean-token-mean",
    "gspo_token": "seq-mean-token-mean",
}
"""Policy losses whose source fixes the aggregation: GSPO's objective (and GSPO-token's) is
1/G sum_i of the per-response losses (arXiv 2507.18071 §4.1, §4.3), as the gspo recipe sets."""


def loss_agg_mode_advice(algo: AlgorithmConfig) -> str | None:
    """A one-line warning when ``algo`` pairs a policy loss with an aggregation its source does
    not use, else ``None``."""
    wanted = RECOMMENDED_LOSS_AGG_MODE.get(algo.policy_loss)
    if wanted is None or algo.loss_agg_mode == wanted:
        return None
    return (
        f"algorithm.policy_loss={algo.policy_loss} is defined with loss_agg_mode={wanted} (a "
        f"mean over responses); loss_agg_mode={algo.loss_agg_mode} weighs responses otherwise"
    )
