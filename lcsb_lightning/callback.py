"""``LCSBCallback``: Layer-Cyclic Selective Backpropagation for any LightningModule."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlockParams, BlocksSpec, grad_norm, map_trainable_params
from lcsb_lightning.policies import SelectionPolicy, available_policies, build_policy
from lcsb_lightning.selection_image import selection_image
from lcsb_lightning.selective import SelectiveBackprop

BACKWARD_MODES = ("identity", "exact")
MOMENTUM_MODES = ("implicit", "skip", "reset")


class LCSBCallback(Callback):
    r"""Back-propagate only a subset of transformer blocks at each optimizer step.

    At each optimizer step the policy picks ``k`` of the model's ``N`` blocks. The trainable (LoRA)
    parameters of those blocks get ``requires_grad=True``, the others ``False``.

    Args:
        policy: a registered policy name (``"cyclic"``, ``"random"``, ``"grad_norm"``, ``"full"``,
            ``"freeze"``) or a :class:`~lcsb_lightning.policies.SelectionPolicy` instance.
        layers_per_step: ``k`` blocks per step. Give this or ``fraction`` (not needed for ``"full"``).
        fraction: ``k = round(fraction * N)``, ``fraction`` in (0, 1].
        backward: ``"identity"`` (the paper's): a non-selected block runs under ``no_grad`` and its
            output enters the graph with an identity Jacobian, so it costs no backward, no recompute
            and no weight decompression. ``"exact"``: only ``requires_grad`` changes; selected
            parameters get their exact full-backprop gradients.
        momentum: ``"implicit"`` (the paper's): non-selected parameters get a zero gradient before the
            optimizer step, so AdamW momentum and weight decay keep moving them. ``"skip"``: their
            gradient stays ``None`` and the optimizer skips them (LISA). ``"reset"``: like ``"skip"``,
            and a block's optimizer state is dropped when it leaves the selection (BAdam).
        blocks: ``"auto"``, a dotted path to the block ``ModuleList`` or a callable ``model -> blocks``.
        switch_every: optimizer steps between re-selections.
        seed: seed of the policy's generator (ignored when ``policy`` is an instance).
        log_every_n_steps: optimizer steps between block-selection images (``0`` disables them).

    Multiple processes: every rank selects the same blocks (the policy state is seeded and the
    gradient norms it observes are read after DDP's all-reduce). Under DDP, parameters of
    non-selected blocks receive no gradient, so use ``strategy="ddp_find_unused_parameters_true"``.

    Example::

        from lightning.pytorch import Trainer
        from lcsb_lightning import LCSBCallback

        trainer = Trainer(max_steps=1000, callbacks=[LCSBCallback("cyclic", fraction=0.25)])
        trainer.fit(my_lora_module)  # any LightningModule whose model has LoRA-adapted blocks
    """

    def __init__(
        self,
        policy: str | SelectionPolicy = "cyclic",
        layers_per_step: int | None = None,
        fraction: float | None = None,
        backward: str = "identity",
        momentum: str = "implicit",
        blocks: BlocksSpec = "auto",
        switch_every: int = 1,
        seed: int = 0,
        log_every_n_steps: int = 50,
    ) -> None:
        if backward not in BACKWARD_MODES:
            raise ValueError(f"`backward={backward!r}` is not supported; allowed: {', '.join(BACKWARD_MODES)}.")
        if momentum not in MOMENTUM_MODES:
            raise ValueError(f"`momentum={momentum!r}` is not supported; allowed: {', '.join(MOMENTUM_MODES)}.")
        if isinstance(log_every_n_steps, bool) or int(log_every_n_steps) != log_every_n_steps or log_every_n_steps < 0:
            raise ValueError(f"`log_every_n_steps` must be an integer >= 0, got {log_every_n_steps!r}.")
        if isinstance(policy, SelectionPolicy):
            if layers_per_step is not None or fraction is not None:
                raise ValueError(
                    "`layers_per_step`/`fraction` configure a policy built by name; a SelectionPolicy "
                    f"instance ({policy!r}) carries its own size."
                )
            self.policy = policy
        elif isinstance(policy, str):
            if policy not in available_policies():
                raise ValueError(f"Unknown policy {policy!r}; available: {', '.join(available_policies())}.")
            self.policy = build_policy(
                policy, layers_per_step=layers_per_step, fraction=fraction, switch_every=switch_every, seed=seed
            )
        else:
            raise TypeError(f"`policy` must be a name or a SelectionPolicy, got {type(policy).__name__}.")
        self.backward, self.momentum, self.blocks = backward, momentum, blocks
        self.log_every_n_steps = int(log_every_n_steps)

        self.selection: tuple[int, ...] = ()
        self.selection_counts: list[int] = []
        self._selected_at_step = -1
        self._observed_at_step = -1
        self._history: list[tuple[int, ...]] = []
        self._pending_state: dict[str, Any] | None = None
        self._block_params: BlockParams | None = None
        self._selective: SelectiveBackprop | None = None
        self._image_unsupported_reported = False

    # ------------------------------------------------------------------------------ setup & teardown
    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=type(self.policy).__name__, backward=self.backward)

    @property
    def num_blocks(self) -> int:
        return 0 if self._block_params is None else self._block_params.num_blocks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._release()
        self._block_params = map_trainable_params(pl_module, self.blocks)
        self.policy.setup(self._block_params.num_blocks)
        self.selection_counts = [0] * self._block_params.num_blocks
        self._selected_at_step, self._observed_at_step, self.selection, self._history = -1, -1, (), []
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        if self.backward == "identity":
            self._selective = SelectiveBackprop(self._block_params.blocks)
        if self._block_params.outside:
            rank_zero_info(
                f"LCSB leaves {len(self._block_params.outside)} trainable parameters outside the blocks "
                f"always trained (e.g. {', '.join(self._block_params.outside[:3])})."
            )
        rank_zero_info(
            f"LCSB: {self.policy!r} over {self.num_blocks} blocks, k={self.policy.k}, "
            f"backward={self.backward}, momentum={self.momentum}."
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._block_params is not None
        in_optimizer = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        missing = [
            name
            for names, params in zip(self._block_params.names_per_block, self._block_params.params_per_block)
            for name, p in zip(names, params)
            if id(p) not in in_optimizer
        ]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable block parameters are in no optimizer param group "
                f"(e.g. {', '.join(missing[:3])}). LCSB never rebuilds param groups: build the optimizer in "
                "`configure_optimizers` from every trainable parameter (LCSB only toggles requires_grad "
                "after it has run)."
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        """Leave the model as found: every managed parameter trainable, original forwards back."""
        if self._block_params is not None:
            for p in self._block_params.all_block_params():
                p.requires_grad_(True)
        if self._selective is not None:
            self._selective.remove()
            self._selective = None

    # ---------------------------------------------------------------------------------- the step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step  # counts optimizer steps: constant across an accumulation window
        if step == self._selected_at_step:
            return
        previous, selection = self.selection, self.policy.select(step)
        self._apply_selection(trainer, previous, selection)
        self.selection, self._selected_at_step = selection, step
        for i in selection:
            self.selection_counts[i] += 1
        self._history.append(selection)
        pl_module.log("lcsb/num_selected", float(len(selection)), on_step=True, on_epoch=False)
        if self.log_every_n_steps and len(self._history) >= self.log_every_n_steps:
            self._log_selection_image(trainer, step)

    def _apply_selection(self, trainer: Trainer, previous: tuple[int, ...], selection: tuple[int, ...]) -> None:
        assert self._block_params is not None
        chosen = set(selection)
        for index, params in enumerate(self._block_params.params_per_block):
            for p in params:
                p.requires_grad_(index in chosen)
        if self._selective is not None:
            self._selective.set_selection(selection)
        if self.momentum == "reset":
            for index in set(previous) - chosen:
                for p in self._block_params.params_per_block[index]:
                    for optimizer in trainer.optimizers:
                        optimizer.state.pop(p, None)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        assert self._block_params is not None
        if self._observed_at_step != trainer.global_step:  # once per step, even with several optimizers
            self._observed_at_step = trainer.global_step
            norms = {i: grad_norm(self._block_params.params_per_block[i]) for i in self.selection}
            self.policy.observe(norms)
            pl_module.log_dict(
                {f"lcsb/grad_norm/block_{i:02d}": v for i, v in norms.items()}, on_step=True, on_epoch=False
            )
        chosen = set(self.selection)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for index, params in enumerate(self._block_params.params_per_block):
            if index in chosen:
                continue
            for p in params:
                if id(p) not in in_optimizer:
                    continue
                if self.momentum == "implicit":
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad = None

    @rank_zero_only
    def _log_selection_image(self, trainer: Trainer, step: int) -> None:
        image = selection_image(self._history, self.num_blocks)
        self._history = []
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):  # TensorBoard's SummaryWriter
                experiment.add_image("lcsb/selection", image, global_step=step, dataformats="HW")
            elif hasattr(logger, "log_image"):  # W&B, Neptune, ...
                logger.log_image(key="lcsb/selection", images=[image.numpy()], step=step)
            elif not self._image_unsupported_reported:
                self._image_unsupported_reported = True
                rank_zero_warn(f"{type(logger).__name__} cannot log images; the LCSB selection image is skipped.")

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.state_dict(),
            "selection": list(self.selection),
            "selected_at_step": self._selected_at_step,
            "observed_at_step": self._observed_at_step,
            "selection_counts": list(self.selection_counts),
            "history": [list(s) for s in self._history],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.policy.num_blocks == 0:  # restored before setup: apply once the model is known
            self._pending_state = state_dict
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.selection = tuple(state["selection"])
        self._selected_at_step = int(state["selected_at_step"])
        self._observed_at_step = int(state["observed_at_step"])
        self.selection_counts = list(state["selection_counts"])
        self._history = [tuple(s) for s in state["history"]]
