"""Hydra main of the reproduction benchmark (the same job as the ``lcsb-benchmark`` console script).

    python recipes/benchmark.py                       # benchmark=short (about 15 min on 2 CPU cores)
    python recipes/benchmark.py benchmark=full        # the issue's settings

Configs: ``conf/benchmark.yaml`` and ``conf/benchmark/``; outputs: ``outputs/benchmark/<name>/``
(rerun the same command to resume).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lcsb_lightning.recipes.benchmark import hydra_benchmark


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
def main(cfg: DictConfig) -> None:
    """Run the configured benchmark."""
    hydra_benchmark(cfg)


if __name__ == "__main__":
    main()
