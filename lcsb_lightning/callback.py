"""``LCSBCallback``: Layer-Cyclic Selective Backpropagation for any LightningModule."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlocksSpec
from lcsb_lightning.controller import LCSBController, validate_modes
from lcsb_lightning.policies import SelectionPolicy, available_policies, build_policy
from lcsb_lightning.selection_image import selection_image


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
        validate_modes(backward, momentum)
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
        self.controller: LCSBController | None = None
        self._history: list[tuple[int, ...]] = []
        self._pending_state: dict[str, Any] | None = None
        self._image_unsupported_reported = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(policy=type(self.policy).__name__, backward=self.backward)

    @property
    def num_blocks(self) -> int:
        return 0 if self.controller is None else self.controller.num_blocks

    @property
    def selection(self) -> tuple[int, ...]:
        """Blocks back-propagated at the current optimizer step."""
        return () if self.controller is None else self.controller.selection

    @property
    def selection_counts(self) -> list[int]:
        """How many optimizer steps each block has trained in this fit."""
        return [] if self.controller is None else list(self.controller.selection_counts)

    # ------------------------------------------------------------------------------ setup & teardown
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()  # a previous fit that was interrupted before its teardown

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Installed here, not in `setup`: the model now exists (`configure_model` has run), the
        # precision plugin has converted it, the strategy has wrapped it and the optimizers exist.
        self.controller = LCSBController(pl_module, self.policy, self.backward, self.momentum, self.blocks)
        self._history = []
        try:
            if self._pending_state is not None:
                self._apply_state(self._pending_state)
                self._pending_state = None
            missing = self.controller.missing_from(trainer.optimizers)
            if missing:
                raise ValueError(
                    f"{len(missing)} trainable block parameters are in no optimizer param group "
                    f"(e.g. {', '.join(missing[:3])}). LCSB never rebuilds param groups: build the optimizer "
                    "in `configure_optimizers` from every trainable parameter."
                )
        except BaseException:
            self._release()
            raise
        outside = self.controller.block_params.outside
        if outside:
            rank_zero_info(
                f"LCSB leaves {len(outside)} trainable parameters outside the blocks always trained "
                f"(e.g. {', '.join(outside[:3])})."
            )
        rank_zero_info(
            f"LCSB: {self.policy!r} over {self.num_blocks} blocks, k={self.policy.k}, "
            f"backward={self.backward}, momentum={self.momentum}."
        )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()

    def _release(self) -> None:
        if self.controller is not None:
            self.controller.release()

    # ---------------------------------------------------------------------------------- the step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.controller is not None
        # global_step counts optimizer steps, so it is constant across an accumulation window
        selection = self.controller.begin_step(trainer.global_step, trainer.optimizers)
        if selection is None:
            return
        pl_module.log("lcsb/num_selected", float(len(selection)), on_step=True, on_epoch=False)
        if not self.log_every_n_steps:
            return
        self._history.append(selection)
        if len(self._history) >= self.log_every_n_steps:
            self._log_selection_image(trainer, trainer.global_step)
            self._history = []  # on every rank, so the history stays bounded everywhere

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        assert self.controller is not None
        norms = self.controller.before_optimizer_step(optimizer)
        if norms is not None:
            pl_module.log_dict(
                {f"lcsb/grad_norm/block_{i:02d}": v for i, v in norms.items()}, on_step=True, on_epoch=False
            )

    @rank_zero_only
    def _log_selection_image(self, trainer: Trainer, step: int) -> None:
        image = selection_image(self._history, self.num_blocks)
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
        if self.controller is None:
            return dict(self._pending_state or {})
        return {**self.controller.state_dict(), "history": [list(s) for s in self._history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.controller is None:  # restored before setup: apply once the model is known
            self._pending_state = state_dict
        else:
            self._apply_state(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        assert self.controller is not None
        self.controller.load_state_dict(state)
        self._history = [tuple(s) for s in state["history"]]
