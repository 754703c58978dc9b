"""The console scripts ``lcsb-finetune`` and ``lcsb-benchmark``: Hydra apps over the packaged configs.

The configs are the repository's top-level ``conf/`` folder, installed as the package
``lcsb_lightning.conf``, so both commands work from any folder after any install (editable or a
wheel). Add your own config folder with Hydra's ``--config-dir`` (``-cd``); see ``recipes/``.
"""

from __future__ import annotations

import logging
from typing import Any

import hydra
from omegaconf import DictConfig

#: The packaged configs, as Hydra's compose API and ``hydra.main`` name them.
CONFIG_MODULE = "lcsb_lightning.conf"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


class _NoTips(logging.Filter):
    """Drops Lightning's advertising tips ("💡 Tip: ... try installing ...")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "💡 Tip" not in record.getMessage()


def quiet_lightning_logging() -> None:
    """One line per message: Lightning's own console handler goes (Hydra's root handlers print and
    write ``<job>.log``), and its advertising tips are filtered out."""
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
    tips = _NoTips()
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(tips)


def hydra_task(cfg: DictConfig) -> float | None:
    """Run one fine-tuning job in Hydra's output directory; returns its final eval loss (for sweepers)."""
    from hydra.core.hydra_config import HydraConfig

    from lcsb_lightning.recipes.train import run_finetune

    quiet_lightning_logging()
    summary = run_finetune(cfg, HydraConfig.get().runtime.output_dir)
    return summary["final_metrics"].get("val/loss")


def hydra_benchmark(cfg: DictConfig) -> None:
    """Run the configured benchmark in Hydra's output directory."""
    from hydra.core.hydra_config import HydraConfig

    from lcsb_lightning.bench.runner import run_benchmark

    quiet_lightning_logging()
    data_dir = cfg.get("data_dir")
    extra = [f"data_dir={data_dir}"] if data_dir else []
    run_benchmark(cfg.benchmark, HydraConfig.get().runtime.output_dir, lambda overrides: compose_finetune([*extra, *overrides]))


def compose_finetune(overrides: Any) -> DictConfig:
    """Compose the fine-tuning config (``config.yaml``) with ``overrides`` inside a running Hydra app."""
    from hydra import compose

    return compose(config_name="config", overrides=list(overrides))


def finetune_main() -> None:
    """``lcsb-finetune [overrides...]`` and ``lcsb-finetune --multirun policy=full,cyclic``."""
    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")(hydra_task)()


def benchmark_main() -> None:
    """``lcsb-benchmark [benchmark=short|standard|full] [overrides...]``: the benchmark studies."""
    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="benchmark")(hydra_benchmark)()


if __name__ == "__main__":
    finetune_main()
