"""``QuantizedMeBP``: the Lightning ``Precision`` plugin around :func:`apply_mebp`."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Literal, get_args

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lcsb_lightning.mebp._internal.heap import trim_count
from lcsb_lightning.mebp._internal.stats import MeBPStats
from lcsb_lightning.mebp._internal.storage import MappedWeights, maps_for_training
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp.config import DEFAULT_CONFIG, MeBPConfig, build_config
from lcsb_lightning.mebp.convert import MeBPState, apply_mebp, map_compressed, mebp_state


def _skip_ddp_buffer_sync(module: nn.Module) -> None:
    """Keep DDP from broadcasting the compressed codes every step (every rank derives the same ones)."""
    names = [f"{name}.{buffer}" for name, sub in module.named_modules()
             if isinstance(sub, (CompressedLinear, CompressedEmbedding))
             for buffer in ("weight", "scales", "mins") if getattr(sub, buffer) is not None]  # symmetric: no minimums
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    module._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]  # type: ignore[assignment]


def _place_weights(state: MeBPState) -> None:
    """Map the compressed weights of a model that trains on the CPU, let go of those of one that trains elsewhere."""
    config, store = state.config, state.weight_store
    modules = list(state.compressed_modules.values())
    device = modules[0].weight.device
    mapped = maps_for_training(config.weights, device, config.offload_dir)
    if config.weights == "mmap" and device.type != "cpu":
        rank_zero_warn(f"QuantizedMeBP: weights='mmap' has no effect on a model that trains on {device}: its compressed "
                       "weights are in device memory; use weights='auto' (the default) to write no files.")
    if mapped and store is None:
        store = MappedWeights(config.offload_dir)
        map_compressed(state.compressed_modules, store)
    elif not mapped and store is not None:
        store.close()  # a model moved off the CPU dropped its mappings with its CPU tensors
        store = None
    state.weight_store = store
    for module in modules:
        module.weight_store = store  # type: ignore[assignment]


_Precision = Literal["32-true", "bf16-mixed"]
#: The Trainer precisions QuantizedMeBP runs with.
PRECISIONS: tuple[str, ...] = get_args(_Precision)


class QuantizedMeBP(Precision):
    """Memory-efficient backprop (MeBP) on compressed frozen weights, as a Trainer plugin.

    ``convert_module`` runs :func:`apply_mebp` in ``Trainer.fit`` before the strategy wraps the model
    (single-device and DDP alike; a model already converted is left as it is). Composes with
    ``LCSBCallback``: a block LCSB skips is neither recomputed nor decompressed in backward. Per optimizer
    step it logs the ``mebp/...`` timings and ``mebp/heap_trims`` every ``log_every_n_steps``
    (docs/mebp.md, "Instrumentation"); the latest values are in :attr:`last_metrics`.

    Args:
        config: The conversion options (:class:`~lcsb_lightning.mebp.MeBPConfig`; its defaults without
            one); LightningCLI configures it field by field (``--trainer.plugins.config.fmt=int4``).
        precision: The Trainer precision it stands for: ``"32-true"`` (float32, the default) or
            ``"bf16-mixed"`` (the steps run under bfloat16 autocast).
        **options: :class:`~lcsb_lightning.mebp.MeBPConfig` fields by keyword (``fmt="int4"``): without
            ``config`` they build one, beside it they override its fields.

    Raises:
        TypeError: an option that is not a ``MeBPConfig`` field, or a bad value (see ``MeBPConfig``).
        ValueError: an unsupported ``precision``, or a bad value (see ``MeBPConfig``).

    Example::

        >>> plugin = QuantizedMeBP(fmt="int4", group_size=64)  # or QuantizedMeBP(MeBPConfig(fmt="int4"))
        >>> # trainer = Trainer(plugins=[plugin]); trainer.fit(lora_module)
    """

    precision = "32-true"

    def __init__(self, config: MeBPConfig = DEFAULT_CONFIG, *, precision: _Precision = "32-true",
                 **options: Any) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"QuantizedMeBP: precision={precision!r} is not supported; allowed: {', '.join(PRECISIONS)}")
        self.config = build_config(config, options, "QuantizedMeBP")
        self.precision = precision  # type: ignore[assignment]
        self._module: nn.Module | None = None
        self.stats = MeBPStats()  #: the converted model's timers, once convert_module ran
        self.last_metrics: dict[str, float] = {}
        self._trims_at_last_step = trim_count()

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Compress ``module`` in place (a no-op on a model already converted or loaded compressed)."""
        if mebp_state(module) is None:
            apply_mebp(module, self.config)
        _skip_ddp_buffer_sync(module)
        self._module = module
        state = mebp_state(module)
        assert state is not None
        self.stats = state.stats  # looked up once: mebp_state may walk every module
        self.stats.sync_timing = self.config.sync_timing
        self.stats.reset()
        self._trims_at_last_step = trim_count()
        return module

    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        """Place the compressed weights for the device the strategy moved the model to (``weights``)."""
        state = mebp_state(self._module) if self._module is not None else None
        if state is not None:
            _place_weights(state)
        return super().connect(model, optimizers, lr_schedulers)

    @property
    def offload_path(self) -> str | None:
        """The current offload directory (``None`` without ``offload="mmap"``)."""
        state = mebp_state(self._module) if self._module is not None else None
        return state.offload.path if state is not None and state.offload is not None else None

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """bfloat16 autocast with ``precision="bf16-mixed"`` (on the model's device), nothing with ``"32-true"``."""
        if self.precision != "bf16-mixed":
            with super().forward_context():
                yield
            return
        device = getattr(self._module, "device", torch.device("cpu"))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield

    @contextlib.contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        stats = self.stats
        enabled, stats.enabled = stats.enabled, False
        try:
            with super().val_step_context():
                yield
        finally:
            stats.enabled = enabled

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        with self.stats.time_backward(tensor.device):
            super().backward(tensor, model, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, model, closure, **kwargs)
        if self.config.free_grads_after_step and getattr(model, "automatic_optimization", False):
            # Lightning zeroes the gradients between the next forward and its backward; freed now, they
            # are not held through that forward, where the peak of a step with few trainable blocks is.
            optimizer.zero_grad(set_to_none=True)
        trims = trim_count()
        self.last_metrics = {**self.stats.as_dict(), "mebp/heap_trims": float(trims - self._trims_at_last_step)}
        self._trims_at_last_step = trims
        self.stats.reset()
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.loggers and (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) == 0:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=trainer.global_step)
        return output

    def teardown(self) -> None:
        """Remove the offload directory (end of fit, exception or KeyboardInterrupt)."""
        state = mebp_state(self._module) if self._module is not None else None
        if state is not None:
            state.close()
        super().teardown()
