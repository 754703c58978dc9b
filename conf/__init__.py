"""The Hydra configs of lcsb-finetune and lcsb-benchmark.

This folder is installed as the package ``lcsb_lightning.conf`` (see pyproject.toml), so that
Hydra finds the configs (``pkg://lcsb_lightning.conf``) from any install, editable or not.
"""

# Hydra imports this package to read the configs: the schema that conf/config.yaml names is registered first.
import lcsb_lightning.recipes.config  # noqa: E402, F401
