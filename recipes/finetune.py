"""Hydra main of the fine-tuning recipe (the same job as the ``lcsb-finetune`` console script).

    python recipes/finetune.py                                   # SmolLM2-135M, task=pydoc, cyclic LCSB
    python recipes/finetune.py model=smollm2_135m task=wikitext2 policy=cyclic
    python recipes/finetune.py --multirun policy=full,cyclic,random,grad_norm

Configs live in ``conf/``; outputs go to ``outputs/finetune/<date_time>/`` (``multirun/...`` for sweeps).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lcsb_lightning.recipes.cli import hydra_task


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Run one fine-tuning job; returns the final evaluation loss."""
    return hydra_task(cfg)


if __name__ == "__main__":
    main()
