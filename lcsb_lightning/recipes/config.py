"""The schema of ``lcsb-finetune``'s config: Hydra structured configs whose ``__post_init__`` checks every value.

``conf/config.yaml`` lists it first (``finetune_schema``), so a value of the wrong type fails while Hydra composes;
:func:`check_config` runs the value checks before anything is built. The nodes of library objects (``policy``,
``lcsb``, ``guard``, ``freeze``, ``mebp``) are checked by building what they configure. The values are in
``conf/config.yaml``; the ``trainer`` node and the root also take keys the schema does not name."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import MISSING, DictConfig, OmegaConf

# Imported here, before peft: importing lcsb_lightning.mebp installs the filter of bitsandbytes' CPU-kernel notice.
from lcsb_lightning.export import MERGED_TYPES
from lcsb_lightning.mebp import MeBPConfig
from lcsb_lightning.policies import SelectionPolicy
from lcsb_lightning.recipes.best_adapter import BestAdapter

#: The schema's name in Hydra's ``ConfigStore`` (the first entry of ``conf/config.yaml``'s defaults).
SCHEMA_NAME = "finetune_schema"
#: Context length of the model options whose config is known without loading anything.
KNOWN_CONTEXT = {"lcsb_lightning.recipes.models.smollm2_135m": 8192}
#: ``transformers.get_scheduler`` names ``CausalLMModule`` takes (``*_min_lr`` ones use ``min_lr_ratio``).
SCHEDULES = ("cosine_with_min_lr", "cosine", "linear", "constant_with_warmup", "constant")


def _fail(problems: list[str]) -> None:
    if problems:
        raise ValueError("invalid configuration: " + "; ".join(problems))


def _at_least(problems: list[str], name: str, value: int, minimum: int) -> None:
    if value < minimum:
        problems.append(f"{name}={value!r}: allowed: an integer >= {minimum}")


def _open(cls: type) -> DictConfig:
    """``cls`` as a structured config that also takes keys it does not declare."""
    node = OmegaConf.structured(cls)
    OmegaConf.set_struct(node, False)
    return node


@dataclass
class ModuleConfig:
    """``module``: the arguments of :class:`~lcsb_lightning.recipes.module.CausalLMModule` (built partially)."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING
    warmup_steps: int = MISSING
    schedule: str = MISSING
    min_lr_ratio: float = MISSING
    chunked_loss: bool = MISSING
    chunk_size: int = MISSING
    init_adapter: Optional[str] = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.lr > 0:
            problems.append(f"module.lr={self.lr!r}: allowed: a number > 0")
        if self.weight_decay < 0:
            problems.append(f"module.weight_decay={self.weight_decay!r}: allowed: a number >= 0")
        _at_least(problems, "module.warmup_steps", self.warmup_steps, 0)
        if self.schedule not in SCHEDULES:
            problems.append(f"module.schedule={self.schedule!r}: allowed: {', '.join(SCHEDULES)}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"module.min_lr_ratio={self.min_lr_ratio!r}: allowed: a number in [0, 1]")
        _at_least(problems, "module.chunk_size", self.chunk_size, 1)
        _fail(problems)


@dataclass
class TrainerConfig:
    """``trainer``: the ``lightning.Trainer`` arguments the recipe relies on (any other one may be added)."""

    _target_: str = MISSING
    max_steps: int = MISSING
    val_check_interval: Optional[Union[int, float]] = None
    log_every_n_steps: int = MISSING
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True

    def __post_init__(self) -> None:
        problems: list[str] = []
        _at_least(problems, "trainer.max_steps", self.max_steps, 1)
        interval = self.val_check_interval
        if interval is not None and not interval > 0:
            problems.append(f"trainer.val_check_interval={interval!r}: allowed: a number > 0 or null")
        _at_least(problems, "trainer.accumulate_grad_batches", self.accumulate_grad_batches, 1)
        _fail(problems)


@dataclass
class LCSBConfig:
    """``lcsb``: the options of :class:`~lcsb_lightning.LCSBCallback` (typed here, checked by the callback)."""

    _target_: str = MISSING
    backward: str = MISSING
    unreached: str = MISSING
    blocks: Any = MISSING
    log_every_n_steps: int = MISSING
    probe_every: int = MISSING


def _build_check(key: str, node: Any, **kwargs: Any) -> Any:
    """Build the library object that the node ``key`` configures (cheap: no model, no file), so that its own
    constructor (for ``mebp``: :class:`~lcsb_lightning.mebp.MeBPConfig`) checks the values; None where the
    node has no ``_target_`` (an option such as ``guard=none``)."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        return None
    try:
        return MeBPConfig.from_node(node) if key == "mebp" else instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, (ValueError, TypeError)) else exc
        raise ValueError(f"invalid configuration: {key}: {cause}") from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid configuration: {key}: {exc}") from None


@dataclass
class ExportConfig:
    """GGUF out: the base file with the adapter merged in (``merged.gguf``), its adapted tensors' type."""

    merged: bool = False
    merged_type: str = "F16"


@dataclass
class FinetuneConfig:
    """The composed ``lcsb-finetune`` config (``conf/config.yaml`` and its groups)."""

    seed: int = MISSING
    data_dir: Optional[str] = None
    seq_len: int = MISSING
    batch_size: int = MISSING
    eval_batch_size: int = MISSING
    eval_before_training: bool = True
    checkpoint_every: int = MISSING
    resume: Optional[str] = None
    best_adapter: Optional[str] = "val/loss"
    best_adapter_mode: str = "min"
    early_stopping_patience: Optional[int] = None
    keep_activations: Optional[int] = None
    module: ModuleConfig = field(default_factory=lambda: OmegaConf.structured(ModuleConfig))
    export: ExportConfig = field(default_factory=lambda: OmegaConf.structured(ExportConfig))
    trainer: TrainerConfig = field(default_factory=lambda: _open(TrainerConfig))
    lcsb: Optional[LCSBConfig] = None
    # The group options: nodes of `_target_` objects, each checked by what it builds.
    policy: Any = None
    model: Any = None
    task: Any = None
    lora: Any = None
    mebp: Any = None
    logger: Any = None
    guard: Any = None
    freeze: Any = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        _at_least(problems, "seq_len", self.seq_len, 2)
        for key in ("batch_size", "eval_batch_size", "checkpoint_every"):
            _at_least(problems, key, getattr(self, key), 1)
        model = self.model if isinstance(self.model, Mapping) else {}
        context = KNOWN_CONTEXT.get(model.get("_target_", ""))
        if isinstance(model.get("config"), Mapping) and model["config"].get("max_position_embeddings") is not None:
            context = int(model["config"]["max_position_embeddings"])
        if context is not None and self.seq_len > context >= 2:
            problems.append(f"seq_len={self.seq_len} is above the model's context of {context}: allowed: 2..{context}")
        if self.early_stopping_patience is not None:
            if self.best_adapter is None:
                problems.append(
                    f"early_stopping_patience={self.early_stopping_patience} watches best_adapter's metric, and "
                    "best_adapter is null: allowed: a metric for best_adapter (val/loss), or early_stopping_patience=null"
                )
            _at_least(problems, "early_stopping_patience", self.early_stopping_patience, 1)
        if self.keep_activations is not None:
            _at_least(problems, "keep_activations", self.keep_activations, 1)
        if self.export.merged_type not in MERGED_TYPES:
            problems.append(f"export.merged_type={self.export.merged_type!r}: allowed: {', '.join(MERGED_TYPES)}")
        _fail(problems)
        if self.best_adapter is not None:
            try:
                BestAdapter("adapter_best", self.best_adapter, self.best_adapter_mode)
            except ValueError as exc:
                raise ValueError(f"invalid configuration: best_adapter: {exc}") from None
        policy = _build_check("policy", self.policy)
        if policy is not None and not isinstance(policy, SelectionPolicy):
            raise ValueError(
                f"invalid configuration: policy: {self.policy['_target_']} is not a SelectionPolicy; allowed: a "
                "lcsb_lightning.policies class (a policy option of conf/policy), with LCSBCallback's options in the "
                "lcsb node (lcsb.backward=...)"
            )
        if policy is not None:
            _build_check("lcsb", vars(self.lcsb) if self.lcsb is not None else None, policy=policy)
        for key in ("guard", "freeze", "mebp"):
            _build_check(key, getattr(self, key))


ConfigStore.instance().store(name=SCHEMA_NAME, node=_open(FinetuneConfig))


def check_config(cfg: DictConfig) -> FinetuneConfig:
    """Check every value of a composed (or saved) ``lcsb-finetune`` config before anything is built.

    Example::

        >>> check_config(OmegaConf.create({"seed": 0, "seq_len": 1, "batch_size": 2, "eval_batch_size": 4,
        ...     "checkpoint_every": 50, "module": {"_target_": "m", "lr": 5e-4, "weight_decay": 0.0, "betas": [0.9, 0.999],
        ...     "warmup_steps": 0, "schedule": "constant", "min_lr_ratio": 0.0, "chunked_loss": False, "chunk_size": 64},
        ...     "trainer": {"_target_": "lightning.Trainer", "max_steps": 10, "log_every_n_steps": 5}}))
        Traceback (most recent call last):
        ...
        ValueError: invalid configuration: seq_len=1: allowed: an integer >= 2

    Raises:
        ValueError: a value outside what its field allows (the field, the value and the allowed values named).
        omegaconf.errors.ValidationError: a value of the wrong type.
        omegaconf.errors.MissingMandatoryValue: a value the config does not give.
    """
    trainer = cfg.get("trainer")
    if isinstance(trainer, Mapping) and isinstance(trainer.get("_target_"), str):  # the open node: catch a typo
        known = inspect.signature(get_class(trainer["_target_"])).parameters
        unknown = [key for key in trainer if key != "_target_" and key not in known]
        if unknown:
            raise ValueError(f"invalid configuration: trainer.{unknown[0]}: allowed: an argument of {trainer['_target_']}")
    return OmegaConf.to_object(OmegaConf.merge(_open(FinetuneConfig), cfg))
