"""``LCSBCallback``: Layer-Cyclic Selective Backpropagation for any LightningModule."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch.optim import Optimizer

from lcsb_lightning.blocks import BlocksSpec
from lcsb_lightning.controller import LCSBController, validate_modes
from lcsb_lightning.fit_scoped import FitScopedCallback
from lcsb_lightning.policies import SelectionPolicy, build_policy
from lcsb_lightning.probe import ProbeResult, probe_gradients
from lcsb_lightning.selection_image import probe_image, selection_image
from lcsb_lightning.validation import check_int

_PROBES_KEPT = 10_000
#: The backward modes' names in 0.4, which a 0.4 checkpoint's state key for this callback holds.
_BACKWARD_NAMES_OF_0_4 = {"exact": "selected_only", "truncated": "all_reached"}


def _check_strategy(trainer: Trainer) -> None:
    name = type(trainer.strategy).__name__
    if name == "DeepSpeedStrategy":
        raise ValueError(
            f"LCSBCallback does not support `{name}` (DeepSpeed partitions parameters outside autograd's view of "
            "them). Use `strategy=\"ddp\"` (no find_unused_parameters needed) or `ModelParallelStrategy` with "
            "`fully_shard` (FSDP2)."
        )
    if name == "FSDPStrategy":
        rank_zero_warn(
            f"LCSBCallback under `{name}` (FSDP1) is tested only on CUDA machines (tests/test_fsdp.py); "
            "`ModelParallelStrategy` with `fully_shard` (FSDP2) is tested on every machine."
        )


class LCSBCallback(FitScopedCallback):
    r"""Back-propagate only a subset of transformer blocks at each optimizer step.

    The policy picks ``k`` of the ``N`` blocks per step; the others are cut out of the backward (see ``backward``) and
    their trainable parameters get an exact zero gradient, ``requires_grad`` untouched, so plain DDP needs no
    ``find_unused_parameters`` (FSDP2 works too, DeepSpeed is refused). Installed in ``on_fit_start``, removed when fit
    ends or fails. The defaults won docs/results.md's study; the LCSB paper's method is
    ``LCSBCallback("cyclic", fraction=0.25, backward="identity")``.

    Args:
        policy: a registered policy name (``"dyadic"``, ``"cyclic"``, ``"random"``, ``"grad_norm"``, ``"full"``,
            ``"top_only"``) or a :class:`~lcsb_lightning.policies.SelectionPolicy` instance.
        layers_per_step: ``k`` blocks per step, for the policies that need a size (or ``fraction``).
        fraction: ``k = round(fraction * N)``, ``fraction`` in (0, 1].
        backward: ``"all_reached"``: the exact backward from the top down to the lowest selected block, and every
            block it reaches trains. ``"selected_only"``: the same backward, only the selected blocks train.
            ``"identity"`` (the paper's): a non-selected block runs under ``no_grad`` with an identity Jacobian.
        unreached: what a trainable tensor this step's backward did not reach gets. ``"skip_below"``: a block a zero
            gradient, a tensor below the first block (an untied embedding) none; ``"implicit"``: a zero gradient
            for both (the paper's). A tied embedding gets the head's gradient either way.
        blocks: ``"auto"``, a dotted path to the block ``ModuleList`` or a callable ``model -> blocks``.
        switch_every: optimizer steps between re-selections of a policy built by name (default 1).
        seed: seed of the generator of a policy built by name (default 0); a policy instance carries its own.
        log_every_n_steps: optimizer steps between block-selection images (``0`` disables them).
        probe_every: every this many optimizer steps (``0``: never), the exact gradient once more on the same batch,
            and per trained block the cosine and norm ratio of the step's to it (:attr:`probe_results`).

    Example::

        from lightning.pytorch import Trainer
        from lcsb_lightning import LCSBCallback

        trainer = Trainer(max_steps=1000, callbacks=[LCSBCallback()])
        trainer.fit(my_lora_module)  # any LightningModule whose model has LoRA-adapted blocks
    """

    def __init__(
        self, policy: str | SelectionPolicy = "dyadic", layers_per_step: int | None = None,
        fraction: float | None = None, backward: str = "all_reached", unreached: str = "skip_below",
        blocks: BlocksSpec = "auto", switch_every: int | None = None, seed: int | None = None,
        log_every_n_steps: int = 50, probe_every: int = 0
    ) -> None:
        validate_modes(backward, unreached)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, 0)
        self.probe_every = check_int("probe_every", probe_every, 0)
        if isinstance(policy, SelectionPolicy):
            given = {"layers_per_step": layers_per_step, "fraction": fraction, "switch_every": switch_every, "seed": seed}
            for name, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"`{name}={value!r}` configures a policy built by name; a SelectionPolicy instance "
                        f"({policy!r}) carries its own."
                    )
            self.policy = policy
        elif isinstance(policy, str):
            self.policy = build_policy(
                policy, layers_per_step=layers_per_step, fraction=fraction,
                switch_every=1 if switch_every is None else switch_every, seed=0 if seed is None else seed,
            )
        else:
            raise TypeError(f"`policy` must be a name or a SelectionPolicy, got {type(policy).__name__}.")
        self.backward, self.unreached, self.blocks = backward, unreached, blocks
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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()  # a previous fit that was interrupted before its teardown

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _check_strategy(trainer)
        # Not in `setup`: the model is now converted and wrapped, and the optimizers exist.
        self.controller = LCSBController(pl_module, self.policy, self.backward, self.unreached, self.blocks)
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
                f"them (on the others: unreached={self.unreached}), those above it (the head, "
                "the final norm) at every step."
            )
        rank_zero_info(
            f"LCSB: {self.policy!r} over {self.num_blocks} blocks, "
            + (f"k={self.policy.k}, " if self.policy.needs_size else "")
            + f"backward={self.backward}, unreached={self.unreached}."
        )

    def _release(self) -> None:
        if self.controller is not None:
            self.controller.release()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.controller is not None
        # global_step counts optimizer steps, so it is constant across an accumulation window
        if self.probe_every and trainer.global_step % self.probe_every == 0:
            self._probe_batch = (batch, batch_idx)
        selection = self.controller.begin_step(trainer.global_step)
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
        result = probe_gradients(
            trainer.global_step, self.controller.block_params.params_per_block, self.controller.selection,
            lambda: _training_loss(trainer, pl_module, batch, batch_idx), self.controller.selective,
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

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of 0.4 keys this callback's state by the backward's deprecated name.
        states = checkpoint.get("callbacks") or {}
        for old, new in _BACKWARD_NAMES_OF_0_4.items():
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


def _training_loss(trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> Any:
    # logging muted: a re-run that logs would count its values twice in the epoch's aggregates
    with logging_muted(pl_module), trainer.precision_plugin.train_step_context():
        out = pl_module.training_step(batch, batch_idx)
    return out["loss"] if isinstance(out, dict) else out


_LOG_METHODS = ("log", "log_dict")


@contextmanager
def logging_muted(pl_module: LightningModule) -> Iterator[None]:
    """``pl_module.log`` and ``pl_module.log_dict`` do nothing inside the block, and are restored after it."""
    own = {name: vars(pl_module)[name] for name in _LOG_METHODS if name in vars(pl_module)}
    for name in _LOG_METHODS:
        setattr(pl_module, name, _no_log)
    try:
        yield
    finally:
        for name in _LOG_METHODS:
            if name in own:
                setattr(pl_module, name, own[name])
            else:
                delattr(pl_module, name)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None
