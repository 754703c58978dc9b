"""The ``lcsb-finetune`` / ``lcsb-benchmark`` recipes (importing this package imports nothing else)."""

#: The packaged configs (``conf/``), as Hydra's compose API and ``hydra.main`` name them.
CONFIG_MODULE = "lcsb_lightning.conf"
