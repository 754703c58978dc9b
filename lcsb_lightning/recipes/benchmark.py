"""The reproduction benchmark behind ``lcsb-benchmark``: a thin Hydra main over ``conf/benchmark.yaml``.

    lcsb-benchmark                                  # benchmark=short: smoke run, about 15 min on 2 CPU cores
    lcsb-benchmark benchmark=full                   # the issue's real settings (hours)
    lcsb-benchmark benchmark.studies=[speed]        # one study only

Each arm's fine-tuning config is composed from ``conf/config.yaml`` with the arm's overrides (the same
groups ``lcsb-finetune`` uses). Outputs go to ``outputs/benchmark/<name>/``; rerunning the same
command resumes, skipping the arms whose ``result.json`` exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from lcsb_lightning.bench.runner import run_benchmark


def compose_finetune(overrides: Sequence[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` inside the running Hydra application."""
    from hydra import compose

    return compose(config_name="config", overrides=list(overrides))


def hydra_benchmark(cfg: DictConfig) -> None:
    """Run the configured benchmark in Hydra's output directory."""
    from hydra.core.hydra_config import HydraConfig

    run_benchmark(cfg.benchmark, HydraConfig.get().runtime.output_dir, compose_finetune)
