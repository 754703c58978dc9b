"""Rank-zero messages for the plain-torch core, without importing Lightning's trainer (``lightning.pytorch``).

These are ``lightning_utilities``' helpers, the very functions ``lightning.pytorch.utilities.rank_zero`` re-exports:
once Lightning is imported its logger shows them and its strategies keep ``rank_zero_only.rank`` up to date. Until
then the rank comes from the launcher's environment, as Lightning itself reads it on import.
"""

from __future__ import annotations

import os

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_info", "rank_zero_only", "rank_zero_warn"]

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _environment_rank() -> int:
    """The process's global rank as the launcher's environment gives it (0 without one)."""
    for key in _RANK_VARIABLES:
        value = os.environ.get(key)
        if value is not None:
            return int(value)
    return 0


if getattr(rank_zero_only, "rank", None) is None:  # Lightning sets it the same way, and leaves a value it finds
    rank_zero_only.rank = _environment_rank()  # type: ignore[attr-defined]
