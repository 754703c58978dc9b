"""Console entry point ``lcsb-finetune``: Hydra over the repository's ``conf/`` folder."""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_ENV = "LCSB_CONF_DIR"


def conf_dir() -> Path:
    """The Hydra config folder: ``$LCSB_CONF_DIR``, else ``<repository>/conf`` of the editable install.

    Raises:
        FileNotFoundError: Neither exists (for example after a non-editable install).
    """
    env = os.environ.get(CONF_ENV)
    path = Path(env).expanduser().resolve() if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no config.yaml in {path}; install the repository editable (pip install -e .) "
            f"or set {CONF_ENV}=/path/to/lcsb_lightning/conf"
        )
    return path


def hydra_task(cfg: DictConfig) -> float | None:
    """Run one job in Hydra's output directory and return its final evaluation loss (for sweepers)."""
    from hydra.core.hydra_config import HydraConfig

    from lcsb_lightning.recipes.train import run_finetune

    summary = run_finetune(cfg, HydraConfig.get().runtime.output_dir)
    return summary["final_metrics"].get("val/loss")


def finetune_main() -> None:
    """``lcsb-finetune [overrides...]`` and ``lcsb-finetune --multirun policy=full,cyclic``."""
    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")(hydra_task)()


def benchmark_main() -> None:
    """``lcsb-benchmark [benchmark=short|full] [overrides...]``: the reproduction benchmark (``conf/benchmark.yaml``)."""
    from lcsb_lightning.recipes.benchmark import hydra_benchmark

    hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="benchmark")(hydra_benchmark)()


if __name__ == "__main__":
    finetune_main()
