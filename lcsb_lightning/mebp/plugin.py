"""``QuantizedMeBP``: the Lightning ``Precision`` plugin around :func:`apply_mebp`."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator, Iterable

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lcsb_lightning.mebp.convert import apply_mebp, mebp_state, validate_args
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp._internal.stats import MeBPStats


def _skip_ddp_buffer_sync(module: nn.Module) -> None:
    """Keep DDP from broadcasting the compressed codes every step (every rank derives the same ones)."""
    names = [
        f"{name}.{buffer}"
        for name, sub in module.named_modules()
        if isinstance(sub, (CompressedLinear, CompressedEmbedding))
        for buffer in ("weight", "scales")
    ]
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    module._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]  # type: ignore[assignment]


#: The Trainer precisions QuantizedMeBP runs with.
PRECISIONS = ("32-true", "bf16-mixed")


class QuantizedMeBP(Precision):
    """Memory-efficient backprop (MeBP) on 4-bit frozen weights, as a Trainer plugin.

    ``convert_module`` compresses the frozen Linears of the transformer blocks (and with
    ``compress_embeddings`` the input embedding and LM head) to ``fmt``, installs per-block
    checkpointing and the optional mmap offload; computation stays float32 (or runs under bfloat16
    autocast with ``precision="bf16-mixed"``). Conversion happens in
    ``Trainer.fit`` before the strategy wraps the model, so it works with single-device and DDP
    strategies alike. Composes with ``LCSBCallback``: a block LCSB skips is neither recomputed nor
    decompressed in backward.

    Per optimizer step it logs ``mebp/decompress_fwd_ms``, ``mebp/decompress_bwd_ms`` (including the
    recompute's decompressions), ``mebp/recompute_ms``, ``mebp/backward_ms`` and
    ``mebp/decompress_share_bwd`` to the Trainer's loggers every ``log_every_n_steps``; the latest
    values are in :attr:`last_metrics`.

    Args:
        fmt: ``"int4"`` (plain torch), ``"nf4"`` or ``"fp4"`` (bitsandbytes).
        group_size: Weights per scale.
        checkpoint: Per-block non-reentrant gradient checkpointing.
        offload: ``"none"`` or ``"mmap"``.
        compress_embeddings: Also compress the input embedding and LM head.
        ignore_modules: Module names to keep uncompressed.
        offload_dir: Parent directory of the temporary offload and weight directories.
        weights: ``"ram"`` or ``"mmap"`` (compressed weights in memory-mapped files, resident only
            while their layer runs).
        keep_recomputed_weights: ``False`` decompresses each weight again in backward rather than
            keeping the recompute's copy (lower peak, same gradients, more decompression time).
        release_heap: On CPU, return freed heap memory to the OS before each block runs (glibc; a
            flat resident set instead of one that grows from step to step, for a few percent of step time).
        sync_timing: Synchronise the device before and after every timed decompression, recompute and
            backward (exact wall times, but a stall per layer on a GPU). By default CUDA work is timed
            with CUDA events read when the figures are logged, and CPU work with the wall clock.
        precision: The Trainer precision it stands for (the Trainer takes no other with this plugin):
            ``"32-true"`` (float32, the default) or ``"bf16-mixed"`` (the steps run under bfloat16 autocast).

    Example::

        >>> plugin = QuantizedMeBP(fmt="int4", group_size=64)
        >>> # trainer = Trainer(plugins=[plugin]); trainer.fit(lora_module)
    """

    precision = "32-true"

    def __init__(
        self,
        fmt: str = "nf4",
        group_size: int = 64,
        checkpoint: bool = True,
        offload: str = "none",
        compress_embeddings: bool = True,
        ignore_modules: Iterable[str] = (),
        offload_dir: str | None = None,
        weights: str = "ram",
        keep_recomputed_weights: bool = True,
        release_heap: bool = True,
        sync_timing: bool = False,
        precision: str = "32-true",
    ) -> None:
        ignore_modules = tuple(ignore_modules) if not isinstance(ignore_modules, str) else ignore_modules
        validate_args(fmt, group_size, checkpoint, offload, ignore_modules, weights, keep_recomputed_weights, release_heap)
        self.weights = weights
        self.keep_recomputed_weights = keep_recomputed_weights
        self.release_heap = release_heap
        if not isinstance(sync_timing, bool):
            raise TypeError(f"`sync_timing` must be a bool, got {sync_timing!r}.")
        self.sync_timing = sync_timing
        if precision not in PRECISIONS:
            raise ValueError(f"QuantizedMeBP: precision={precision!r} is not supported; allowed: {', '.join(PRECISIONS)}")
        self.precision = precision  # type: ignore[assignment]
        self.fmt = fmt
        self.group_size = group_size
        self.checkpoint = checkpoint
        self.offload = offload
        self.compress_embeddings = compress_embeddings
        self.ignore_modules = ignore_modules
        self.offload_dir = offload_dir
        self._module: nn.Module | None = None
        self._stats = MeBPStats()
        self.last_metrics: dict[str, float] = {}

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Compress ``module`` in place (a no-op on a model already converted or loaded compressed)."""
        if mebp_state(module) is None:
            apply_mebp(
                module,
                fmt=self.fmt,
                group_size=self.group_size,
                checkpoint=self.checkpoint,
                offload=self.offload,
                compress_embeddings=self.compress_embeddings,
                ignore_modules=self.ignore_modules,
                offload_dir=self.offload_dir,
                weights=self.weights,
                keep_recomputed_weights=self.keep_recomputed_weights,
                release_heap=self.release_heap,
            )
        _skip_ddp_buffer_sync(module)
        self._module = module
        state = mebp_state(module)
        assert state is not None
        self._stats = state.stats  # looked up once: mebp_state may walk every module
        self._stats.sync_timing = self.sync_timing
        self._stats.reset()
        return module

    @property
    def stats(self) -> MeBPStats:
        """The timers of the converted model (a fresh, unattached one before ``convert_module``)."""
        return self._stats

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
        self.last_metrics = self.stats.as_dict()
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
