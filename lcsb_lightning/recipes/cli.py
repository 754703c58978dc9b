"""The console scripts ``lcsb-finetune`` and ``lcsb-benchmark``: Hydra apps over the packaged configs (``conf/``,
installed as ``lcsb_lightning.conf``); add your own config folder with Hydra's ``--config-dir`` (see ``recipes/``)."""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from lcsb_lightning.recipes import CONFIG_MODULE

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


def _no_tips(record: logging.LogRecord) -> bool:
    """Drops Lightning's advertising tips ("💡 Tip: ... try installing ...")."""
    return "💡 Tip" not in record.getMessage()


def quiet_lightning_logging() -> None:
    """One line per message: Lightning's own console handler goes (Hydra's root handlers print and
    write ``<job>.log``); its advertising tips and deprecation notices between libraries are filtered out."""
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_no_tips)
    # Deprecations between the libraries (peft reads transformers' `is_gradient_checkpointing`, Lightning's
    # pytree helper checks torch's `LeafSpec`, torchdata's loader calls torch's `set_vital`): nothing a
    # recipe user can act on.
    for message in (r".*`is_gradient_checkpointing` is deprecated", r".*isinstance\(treespec, LeafSpec\)",
                    r".*'set_vital' is deprecated"):
        warnings.filterwarnings("ignore", message=message)


def resumed_config(resume: str, overrides: list[str]) -> tuple[DictConfig, Path]:
    """The config the run that ``resume=`` names saved when it started, and its folder.

    Raises:
        ValueError: other overrides were given (a resumed run continues with its own settings).
        FileNotFoundError: no checkpoint, or no config beside it.
    """
    from omegaconf import OmegaConf

    from lcsb_lightning.recipes.checkpointing import CHECKPOINT_DIR, resolve_checkpoint
    from lcsb_lightning.recipes.train import RUN_CONFIG_NAME

    others = [o for o in overrides if not o.startswith(("resume=", "hydra."))]
    if others:
        raise ValueError(f"resume= continues a run with its own config; drop the other overrides {others}")
    checkpoint = resolve_checkpoint(resume)
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINT_DIR else checkpoint.parent
    saved = run_dir / RUN_CONFIG_NAME
    if not saved.is_file():
        raise FileNotFoundError(f"resume={resume!r}: the run's config {saved} is missing")
    cfg = OmegaConf.load(saved)
    cfg.resume = str(checkpoint)
    return cfg, run_dir


def hydra_task(cfg: DictConfig) -> float | None:
    """Run one fine-tuning job in Hydra's output directory (with ``resume=``: in the resumed run's
    folder, with its own config); returns its final eval loss (for sweepers)."""
    from hydra.core.hydra_config import HydraConfig

    from lcsb_lightning.recipes.train import run_finetune

    quiet_lightning_logging()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.get("resume"):
        cfg, output_dir = resumed_config(cfg.resume, list(HydraConfig.get().overrides.task))
    summary = run_finetune(cfg, output_dir)
    return summary["final_metrics"].get("val/loss")


def hydra_benchmark(cfg: DictConfig) -> None:
    """Run the configured benchmark in Hydra's output directory; each arm's config is ``config.yaml`` composed
    with the arm's overrides (and the run's ``data_dir``)."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from lcsb_lightning.bench.runner import run_benchmark

    quiet_lightning_logging()
    extra = [f"data_dir={cfg.data_dir}"] if cfg.get("data_dir") else []
    run_benchmark(cfg.benchmark, HydraConfig.get().runtime.output_dir,
                  lambda overrides: compose(config_name="config", overrides=[*extra, *overrides]))


#: The top-level modules each console script needs, and the extra that installs them.
_RECIPES_MODULES = ("hydra", "omegaconf", "torchdata", "transformers", "peft", "tensorboard", "torchmetrics",
                    "datasets", "matplotlib", "gguf")
_BENCH_MODULES = (*_RECIPES_MODULES, "psutil")


def require_extra(script: str, extra: str, modules: tuple[str, ...]) -> None:
    """Exit with one line naming the extra to install when one of ``modules`` is missing (a wheel installed
    without extras), instead of a ``ModuleNotFoundError`` traceback from deep inside the recipes."""
    missing = [name for name in modules if not _found(name)]
    if missing:
        sys.exit(f"{script} needs the `{extra}` extra: pip install \"lcsb-lightning[{extra}]\" "
                 f"(missing: {', '.join(missing)})")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def finetune_main() -> None:
    """``lcsb-finetune [overrides...]`` and ``lcsb-finetune --multirun policy=full,cyclic``."""
    require_extra("lcsb-finetune", "recipes", _RECIPES_MODULES)
    import hydra

    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")(hydra_task)()


def benchmark_main() -> None:
    """``lcsb-benchmark [benchmark=short|standard|full] [overrides...]``: the benchmark studies."""
    require_extra("lcsb-benchmark", "bench", _BENCH_MODULES)
    import hydra

    hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="benchmark")(hydra_benchmark)()


if __name__ == "__main__":
    finetune_main()
