"""Checks of a composed ``lcsb-finetune`` config, run before anything is built, loaded or written."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from lcsb_lightning.controller import BACKWARD_MODES, MOMENTUM_MODES
from lcsb_lightning.guard import ACTIONS
from lcsb_lightning.mebp.config import WEIGHT_STORAGE
from lcsb_lightning.mebp import FORMATS
from lcsb_lightning.policies import available_policies
from lcsb_lightning.selective import DEPRECATED_BACKWARD_MODES

#: Context length of the model options whose config is known without loading anything.
KNOWN_CONTEXT = {"lcsb_lightning.recipes.models.smollm2_135m": 8192}


def _int_at_least(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _problems(cfg: DictConfig) -> list[str]:
    out: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    trainer = cfg.get("trainer") or {}
    need(_int_at_least(trainer.get("max_steps"), 1), f"trainer.max_steps={trainer.get('max_steps')!r}: allowed: an integer >= 1")
    interval = trainer.get("val_check_interval")
    need(interval is None or (isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval > 0),
         f"trainer.val_check_interval={interval!r}: allowed: a number > 0 or null")
    need(_int_at_least(cfg.get("seq_len"), 2), f"seq_len={cfg.get('seq_len')!r}: allowed: an integer >= 2")
    for key in ("batch_size", "eval_batch_size", "checkpoint_every"):
        need(_int_at_least(cfg.get(key), 1), f"{key}={cfg.get(key)!r}: allowed: an integer >= 1")
    module = cfg.get("module") or {}
    lr = module.get("lr")
    need(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0, f"module.lr={lr!r}: allowed: a number > 0")

    policy = cfg.get("policy")
    if policy is not None and "_target_" in policy:
        name = policy.get("policy")
        node = name if isinstance(name, (dict, DictConfig)) else {}
        if isinstance(name, str):
            need(name in available_policies(), f"policy.policy={name!r}: allowed: {', '.join(available_policies())}")
        fraction = policy.get("fraction", node.get("fraction") if node else None)
        need(fraction is None or (isinstance(fraction, (int, float)) and 0 < fraction <= 1),
             f"policy.fraction={fraction!r}: allowed: a number in (0, 1] or null")
        k = policy.get("layers_per_step", node.get("layers_per_step") if node else None)
        need(k is None or _int_at_least(k, 1), f"policy.layers_per_step={k!r}: allowed: an integer >= 1 or null")
        need(policy.get("backward") in (*BACKWARD_MODES, *DEPRECATED_BACKWARD_MODES),
             f"policy.backward={policy.get('backward')!r}: allowed: {', '.join(BACKWARD_MODES)}")
        need(policy.get("momentum") in MOMENTUM_MODES,
             f"policy.momentum={policy.get('momentum')!r}: allowed: {', '.join(MOMENTUM_MODES)}")

    mebp = cfg.get("mebp")
    if mebp is not None and "_target_" in mebp:
        need(mebp.get("fmt") in FORMATS, f"mebp.fmt={mebp.get('fmt')!r}: allowed: {', '.join(FORMATS)}")
        weights = mebp.get("weights", "ram")
        need(weights in WEIGHT_STORAGE, f"mebp.weights={weights!r}: allowed: {', '.join(WEIGHT_STORAGE)}")
    guard = cfg.get("guard")
    if guard is not None and "_target_" in guard:
        need(guard.get("action") in ACTIONS, f"guard.action={guard.get('action')!r}: allowed: {', '.join(ACTIONS)}")

    model = cfg.get("model") or {}
    context = KNOWN_CONTEXT.get(model.get("_target_", ""))
    model_config = model.get("config")
    if model_config is not None and model_config.get("max_position_embeddings") is not None:
        context = int(model_config.get("max_position_embeddings"))
    if context is not None and _int_at_least(cfg.get("seq_len"), 2):
        need(cfg.seq_len <= context, f"seq_len={cfg.seq_len} is above the model's context of {context}: allowed: 2..{context}")
    return out


def validate_config(cfg: DictConfig) -> None:
    """Raise one ``ValueError`` listing every bad value of ``cfg`` with the values allowed.

    Example::

        >>> from omegaconf import OmegaConf
        >>> validate_config(OmegaConf.create({"trainer": {"max_steps": 0}, "seq_len": 128, "batch_size": 2,
        ...     "eval_batch_size": 4, "checkpoint_every": 50, "module": {"lr": 5e-4}}))
        Traceback (most recent call last):
        ...
        ValueError: invalid configuration: trainer.max_steps=0: allowed: an integer >= 1
    """
    problems = _problems(cfg)
    if problems:
        raise ValueError("invalid configuration: " + "; ".join(problems))
