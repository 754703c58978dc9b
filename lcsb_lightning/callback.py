"""``LCSBCallback``: Layer-Cyclic Selective Backpropagation for any LightningModule."""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlocksSpec
from lcsb_lightning.controller import LCSBController, validate_modes
from lcsb_lightning.fit_scoped import FitScopedCallback
from lcsb_lightning.policies import SelectionPolicy, available_policies, build_policy
from lcsb_lightning.probe import ProbeResult, probe_gradients
from lcsb_lightning.selective import DEPRECATED_BACKWARD_MODES
from lcsb_lightning.selection_image import probe_image, selection_image
from lcsb_lightning.validation import check_int

_PROBES_KEPT = 10_000


#: Strategies whose parameter partitioning the zero-gradient path cannot serve, and what to use instead.
_UNSUPPORTED_STRATEGIES = {
    "DeepSpeedStrategy": "DeepSpeed partitions parameters outside autograd's view of them",
}
_UNTESTED_STRATEGIES = ("FSDPStrategy",)


def _check_strategy(trainer: Trainer) -> None:
    name = type(trainer.strategy).__name__
    if name in _UNSUPPORTED_STRATEGIES:
        raise ValueError(
            f"LCSBCallback does not support `{name}` ({_UNSUPPORTED_STRATEGIES[name]}). Use `strategy=\"ddp\"` "
            "(no find_unused_parameters needed) or `ModelParallelStrategy` with `fully_shard` (FSDP2)."
        )
    if name in _UNTESTED_STRATEGIES:
        rank_zero_warn(
            f"LCSBCallback under `{name}` (FSDP1) is tested only on CUDA machines (tests/test_fsdp.py); "
            "`ModelParallelStrategy` with `fully_shard` (FSDP2) is tested on every machine."
        )


class LCSBCallback(FitScopedCallback):
    r"""Back-propagate only a subset of transformer blocks at each optimizer step.

    At each optimizer step the policy picks ``k`` of the model's ``N`` blocks; the others are cut out
    of the backward pass (see ``backward``) and their trainable (LoRA) parameters receive an exact zero
    gradient. ``requires_grad`` is never changed, so the optimizer and the strategy see the trainable
    set ``configure_optimizers`` saw. The callback installs itself in ``on_fit_start``, on the model as
    Lightning trains it (after ``configure_model``, the precision plugin's conversion and the
    strategy's wrapping), and removes itself when fit ends, fails or is interrupted.

    The defaults are the configuration that won this project's study on the real SmolLM2
    (docs/results.md): ``policy="dyadic"`` with ``backward="all_reached"`` back-propagates, exactly, the top
    N/8 blocks every step, N/4 every second step, N/2 every fourth and all of them every eighth. The
    LCSB paper's method is ``LCSBCallback("cyclic", fraction=0.25, backward="identity")``.

    Args:
        policy: a registered policy name (``"dyadic"``, ``"cyclic"``, ``"random"``, ``"grad_norm"``,
            ``"full"``, ``"freeze"``) or a :class:`~lcsb_lightning.policies.SelectionPolicy` instance.
        layers_per_step: ``k`` blocks per step. Give this or ``fraction`` (policies that need a size:
            cyclic, random, grad_norm, freeze).
        fraction: ``k = round(fraction * N)``, ``fraction`` in (0, 1].
        backward: ``"all_reached"``: the backward runs exactly from the top down to the lowest selected
            block and stops there, and every block it reaches trains with its exact gradient (it costs
            their LoRA weight gradients, rank-r matmuls, and nothing below). ``"selected_only"``: the
            same backward, but only the selected blocks train. ``"truncated"`` and ``"exact"``, their
            names before 0.5, are deprecated aliases. ``"identity"`` (the paper's): a non-selected
            block runs under ``no_grad`` and its output enters the graph with an identity Jacobian, so
            it costs no backward, no recompute and no weight decompression, but the gradients of the
            blocks below it are approximations (poor ones on deep models: docs/results.md).
        momentum: ``"implicit"`` (the paper's): non-selected parameters keep a zero gradient, so AdamW
            momentum and weight decay keep moving them. ``"skip"``: their
            gradient stays ``None`` and the optimizer skips them (LISA). ``"reset"``: like ``"skip"``,
            and a block's optimizer state is dropped when it leaves the selection (BAdam). ``"reuse"``:
            a non-selected block gets the raw gradient of the last step that trained it, so AdamW updates
            it at every step as if its gradient had not changed since (one copy of the trainable block
            parameters' gradients, kept in the checkpoint).
        blocks: ``"auto"``, a dotted path to the block ``ModuleList`` or a callable ``model -> blocks``.
        switch_every: optimizer steps between re-selections.
        seed: seed of the policy's generator (ignored when ``policy`` is an instance).
        log_every_n_steps: optimizer steps between block-selection images (``0`` disables them).
        probe_every: every this many optimizer steps (``0``: never), compute the exact gradient once
            more on the same batch and log, per trained block, the cosine and the norm ratio of the
            gradient the step used against it (``lcsb/probe/cos/block_NN``,
            ``lcsb/probe/norm_ratio/block_NN`` and an image ``lcsb/probe``). It costs one more forward
            and full backward on those steps; pick it coprime with the number of groups so that every
            group gets probed. :attr:`probe_results` keeps the measurements.
        update_scale: ``"none"``, or ``"sqrt_period"``: multiply each block's optimizer update by
            ``sqrt(P)``, ``P`` the steps per selection of that block so far. With AdamW and implicit
            momentum a block trained every P-th step otherwise moves ``1/sqrt(P)`` as far as under full
            backprop (dyadic's bottom half: 35%). Needs ``momentum="implicit"``.
        momentum_below: what a step whose backward does not reach them does to the trainable tensors
            below the first block (an untied input embedding, trainable as peft's ``modules_to_save``):
            ``"skip"`` (the default: no gradient, so the optimizer leaves them alone until a backward
            reaches them again), ``"implicit"`` (a zero gradient: AdamW keeps moving them, and updates
            every weight of the embedding at every step) or ``None``, as ``momentum``. On the real
            SmolLM2 with a trainable embedding both learn the same (eval loss 3.191 against 3.190 after
            200 steps) and ``"skip"`` makes the step 1.28x cheaper (docs/results.md). An embedding tied
            to the head gets the head's gradient at every step either way.

    Multiple processes: every rank selects the same blocks (the policy state is seeded and the
    gradient norms it observes are read after the gradient all-reduce). Every trainable parameter gets
    a gradient at every step, so plain ``strategy="ddp"`` works without ``find_unused_parameters``;
    ``ModelParallelStrategy`` with ``fully_shard`` (FSDP2) works too. DeepSpeed is refused at fit start.

    Example::

        from lightning.pytorch import Trainer
        from lcsb_lightning import LCSBCallback

        trainer = Trainer(max_steps=1000, callbacks=[LCSBCallback()])
        trainer.fit(my_lora_module)  # any LightningModule whose model has LoRA-adapted blocks
    """

    def __init__(
        self,
        policy: str | SelectionPolicy = "dyadic",
        layers_per_step: int | None = None,
        fraction: float | None = None,
        backward: str = "all_reached",
        momentum: str = "implicit",
        blocks: BlocksSpec = "auto",
        switch_every: int = 1,
        seed: int = 0,
        log_every_n_steps: int = 50,
        probe_every: int = 0,
        update_scale: str = "none",
        momentum_below: str | None = "skip",
    ) -> None:
        backward = validate_modes(backward, momentum, update_scale, momentum_below)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 0)
        self.probe_every = check_int("probe_every", probe_every, 0)
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
        self.backward, self.momentum, self.blocks, self.update_scale = backward, momentum, blocks, update_scale
        self.momentum_below = momentum_below
        self.probe_results: deque[ProbeResult] = deque(maxlen=_PROBES_KEPT)
        self._probe_batch: tuple[Any, int] | None = None
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
        _check_strategy(trainer)
        # Installed here, not in `setup`: the model now exists (`configure_model` has run), the
        # precision plugin has converted it, the strategy has wrapped it and the optimizers exist.
        self.controller = LCSBController(
            pl_module, self.policy, self.backward, self.momentum, self.blocks, self.update_scale, self.momentum_below
        )
        self._history = []
        try:
            if self._pending_state is not None:
                self._apply_state(self._pending_state)
                self._pending_state = None
            self.controller.scale_updates_of(trainer.optimizers)
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
        if self.probe_every and (trainer.accumulate_grad_batches > 1 or trainer.world_size > 1):
            rank_zero_warn(
                "LCSB's probe compares the step's gradient with the exact gradient of the last micro-batch "
                "on this process; with gradient accumulation or several processes the two sum or average "
                "different batches, so read its cosines as approximate."
            )
        outside = self.controller.block_params.outside
        if outside:
            rank_zero_info(
                f"LCSB: {len(outside)} trainable parameters lie outside the blocks (e.g. {', '.join(outside[:3])}): "
                "those below the first block (an input embedding) train on the steps whose backward reaches "
                f"them (on the others: momentum_below={self.controller.momentum_below}), those above it (the head, "
                "the final norm) at every step."
            )
        rank_zero_info(
            f"LCSB: {self.policy!r} over {self.num_blocks} blocks, "
            + (f"k={self.policy.k}, " if self.policy.needs_size else "")
            + f"backward={self.backward}, momentum={self.momentum}"
            + (f", update_scale={self.update_scale}." if self.update_scale != "none" else ".")
        )

    def _release(self) -> None:
        if self.controller is not None:
            self.controller.release()

    # ---------------------------------------------------------------------------------- the step
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.controller is not None
        # global_step counts optimizer steps, so it is constant across an accumulation window
        if self.probe_every and trainer.global_step % self.probe_every == 0:
            self._probe_batch = (batch, batch_idx)
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
        if self._probe_batch is not None:
            self._probe(trainer, pl_module, *self._probe_batch)
            self._probe_batch = None
        norms = self.controller.before_optimizer_step(optimizer)
        if norms is not None:
            pl_module.log_dict(
                {f"lcsb/grad_norm/block_{i:02d}": v for i, v in norms.items()}, on_step=True, on_epoch=False
            )

    def _probe(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.controller is not None

        def exact_loss() -> Any:
            with _logging_suppressed(pl_module):
                out = pl_module.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, dict) else out

        result = probe_gradients(
            trainer.global_step, self.controller.block_params.params_per_block, self.controller.selection,
            exact_loss, self.controller.selective,
        )
        self.probe_results.append(result)
        values = {f"lcsb/probe/cos/block_{i:02d}": v for i, v in result.cosine.items()}
        values.update({f"lcsb/probe/norm_ratio/block_{i:02d}": v for i, v in result.norm_ratio.items()})
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False)
        self._log_image(trainer, "lcsb/probe", probe_image(list(self.probe_results)[-64:], self.num_blocks), trainer.global_step)

    @rank_zero_only
    def _log_selection_image(self, trainer: Trainer, step: int) -> None:
        self._log_image(trainer, "lcsb/selection", selection_image(self._history, self.num_blocks), step)

    @rank_zero_only
    def _log_image(self, trainer: Trainer, tag: str, image: Any, step: int) -> None:
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):  # TensorBoard's SummaryWriter
                experiment.add_image(tag, image, global_step=step, dataformats="HW")
            elif hasattr(logger, "log_image"):  # W&B, Neptune, ...
                logger.log_image(key=tag, images=[image.numpy()], step=step)
            elif not self._image_unsupported_reported:
                self._image_unsupported_reported = True
                rank_zero_warn(f"{type(logger).__name__} cannot log images; LCSB's images ({tag}) are skipped.")

    # ------------------------------------------------------------------------------------- state
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of 0.4 keys this callback's state by the backward's deprecated name.
        states = checkpoint.get("callbacks") or {}
        for old, new in DEPRECATED_BACKWARD_MODES.items():
            old_key = self._generate_state_key(policy=type(self.policy).__name__, backward=old)
            if new == self.backward and old_key in states and self.state_key not in states:
                states[self.state_key] = states.pop(old_key)

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


class _logging_suppressed:
    """Makes ``self.log``/``self.log_dict`` no-ops while the probe re-runs ``training_step``."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.log = self.module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        del self.module.log, self.module.log_dict
