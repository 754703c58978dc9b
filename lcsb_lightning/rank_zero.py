"""Rank-zero messages for the plain-torch core without importing ``lightning.pytorch``: ``lightning_utilities``'
helpers (which Lightning re-exports), with the rank taken from the launcher's environment until Lightning sets it."""

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
