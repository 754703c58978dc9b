"""Block-selection policies: which transformer blocks are back-propagated at each optimizer step.

========== ===================================================== ===========================
name       selection                                             reference
========== ===================================================== ===========================
cyclic     consecutive groups of k, in turn                      LCSB (arXiv 2602.13073)
random     k random blocks; ``reshuffle`` covers all per cycle   LISA / BAdam random order
grad_norm  EMA of LoRA grad norms + exploration, bounded gaps    importance sampling
full       all blocks                                            full-backprop baseline
top_only   the top k blocks only                                 the paper's Freeze baseline
dyadic     the top N/4 every round, N/2, N on a 3-level ruler    truncated backprop, exact
========== ===================================================== ===========================
"""

from lcsb_lightning.policies.base import (
    SelectionPolicy, available_policies, balanced_groups, build_policy, register_policy,
)
from lcsb_lightning.policies.simple import CyclicPolicy, DyadicPolicy, FullPolicy, TopOnlyPolicy
from lcsb_lightning.policies.stochastic import GradNormPolicy, RandomPolicy

__all__ = [
    "SelectionPolicy", "available_policies", "balanced_groups", "build_policy", "register_policy",
    "CyclicPolicy", "DyadicPolicy", "FullPolicy", "GradNormPolicy", "RandomPolicy", "TopOnlyPolicy",
]
