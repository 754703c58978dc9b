"""Preemption: SIGTERM (SLURM, spot instances) or SIGINT (Ctrl-C) makes a recipe run write checkpoints/last.ckpt
after the current step and exit with 128 + the signal; ``resume=`` then ends exactly where an uninterrupted run does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from _recipes_utils import FAST, compose_cfg, one_thread  # noqa: F401
from lcsb_lightning.recipes.checkpointing import Preempted
from lcsb_lightning.recipes.train import run_finetune

OVERRIDES = [*FAST, "task=pydoc", "task.max_eval_examples=2", "trainer.max_steps=8", "checkpoint_every=100",
             "module.lr=1e-2"]
SIGNAL_AT = 4  # the signal arrives during the training step that reaches this global step


class Losses(Callback):
    """Records the training loss of every step; sends ``signum`` to this process ``when``: during step ``at``,
    during the validation after step ``at``, or at the end of training."""

    def __init__(self, signum: int | None = None, at: int = SIGNAL_AT, when: str = "step") -> None:
        self.signum, self.at, self.when = signum, at, when
        self.losses: list[float] = []

    def _send(self, when: str, trainer: Any, step: int) -> None:
        if self.signum is not None and self.when == when and trainer.state.fn == "fit" and trainer.global_step == step:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._send("step", trainer, self.at - 1)

    def on_validation_batch_start(self, trainer: Any, *args: Any) -> None:
        self._send("validation", trainer, self.at)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._send("end", trainer, trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture
def sigint_default() -> Any:
    """Ctrl-C as an interactive Python process has it, whatever the process running the tests inherited (a
    background job of a script starts with SIGINT ignored); the handler before is put back afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield signal.default_int_handler
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigint_ignored() -> Any:
    """SIGINT ignored, as in a background job of a non-interactive shell or under ``nohup``."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield signal.SIG_IGN
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("fixture", ["sigint_default", "sigint_ignored"])
def test_an_ignored_signal_stays_ignored_and_every_handler_is_given_back(request: pytest.FixtureRequest,
                                                                         tmp_path: Path, fixture: str) -> None:
    from lcsb_lightning.recipes.checkpointing import PreemptionCheckpoint

    sigint_before, sigterm_before = request.getfixturevalue(fixture), signal.getsignal(signal.SIGTERM)
    callback = PreemptionCheckpoint(tmp_path / "last.ckpt")
    callback.on_train_start(None, None)
    try:
        assert signal.getsignal(signal.SIGTERM) == callback._handle
        if sigint_before is signal.SIG_IGN:  # the process was told to ignore it: a Ctrl-C meant for others
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        else:
            assert signal.getsignal(signal.SIGINT) == callback._handle
    finally:
        callback.teardown(None, None, "fit")
    assert signal.getsignal(signal.SIGINT) is sigint_before and signal.getsignal(signal.SIGTERM) is sigterm_before


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def _step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[float]]:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("reference") / "run"
    losses = Losses()
    summary = run_finetune(compose_cfg(OVERRIDES), out, extra_callbacks=[losses])
    return out, summary, losses.losses


def _assert_same_end(out: Path, resumed: dict[str, Any], reference: tuple[Path, dict[str, Any], list[float]]) -> None:
    ref_dir, ref_summary, _ = reference
    assert resumed["steps"] == ref_summary["steps"] == 8 and resumed["resumed_from"].endswith("last.ckpt")
    assert resumed["final_metrics"] == ref_summary["final_metrics"]
    assert resumed["block_selection_counts"] == ref_summary["block_selection_counts"]
    a, b = _adapter(out), _adapter(ref_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_writes_a_checkpoint_and_resume_continues_exactly(tmp_path: Path, reference, sigint_default: Any,
                                                                 name: str, code: int) -> None:
    out = tmp_path / "run"
    cfg = compose_cfg(OVERRIDES)
    stopped = Losses(getattr(signal, name))
    with pytest.raises(Preempted) as raised:
        run_finetune(cfg, out, extra_callbacks=[stopped])
    assert raised.value.code == code
    assert _step(out / "checkpoints" / "last.ckpt") == SIGNAL_AT and len(stopped.losses) == SIGNAL_AT
    assert not (out / "summary.json").exists() and not (out / "adapter").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["last.ckpt"]  # written atomically
    assert signal.getsignal(signal.SIGINT) is sigint_default  # the handlers are given back

    cfg.resume = str(out)
    resumed = Losses()
    summary = run_finetune(cfg, out, extra_callbacks=[resumed])
    assert stopped.losses + resumed.losses == reference[2]
    _assert_same_end(out, summary, reference)


@pytest.mark.parametrize(("when", "saved"), [("validation", 3), ("end", 8)])  # FAST validates every 2 steps
def test_signal_outside_a_training_step(tmp_path: Path, reference, when: str, saved: int) -> None:
    """During validation: it finishes and the run stops after the next step; after the last step: the end state."""
    out = tmp_path / "run"
    cfg = compose_cfg(OVERRIDES)
    stopped = Losses(signal.SIGTERM, at=2, when=when)
    with pytest.raises(Preempted) as raised:
        run_finetune(cfg, out, extra_callbacks=[stopped])
    assert raised.value.code == 143 and _step(out / "checkpoints" / "last.ckpt") == saved == len(stopped.losses)
    assert not (out / "summary.json").exists()

    cfg.resume = str(out)
    resumed = Losses()
    summary = run_finetune(cfg, out, extra_callbacks=[resumed])
    assert stopped.losses + resumed.losses == reference[2]
    _assert_same_end(out, summary, reference)


def test_sigterm_to_the_lcsb_finetune_process(tmp_path: Path) -> None:
    """The console script: exit status 143 after the checkpoint, then ``resume=`` from the command line."""
    script = shutil.which("lcsb-finetune") or str(Path(sys.executable).parent / "lcsb-finetune")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    cmd = [script, *OVERRIDES, "trainer.val_check_interval=100", "trainer.max_steps=150", f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events = out / "tensorboard"
    deadline = time.monotonic() + 300
    while not any(events.glob("events.out.tfevents.*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the training logger starts after the evaluation before training
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-3000:]
    step = _step(out / "checkpoints" / "last.ckpt")
    assert 0 < step < 150 and f"preempted at step {step}" in output and f"resume={out}" in output
    assert not (out / "summary.json").exists()

    done = subprocess.run([script, f"resume={out}", f"hydra.run.dir={out}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 150 and summary["resumed_from"].endswith("last.ckpt")


class SignalAtBatch(Losses):
    """Records every micro-batch's loss; sends ``signum`` at the start of training micro-batch ``at`` (0-based)."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.signum is not None and trainer.state.fn == "fit" and len(self.losses) == self.at:
            os.kill(os.getpid(), self.signum)


def test_signal_inside_an_accumulation_window_saves_at_its_end(tmp_path: Path) -> None:
    """With ``accumulate_grad_batches=2`` a signal after the first micro-batch of a window: the checkpoint is written
    after the window's optimizer step (none holds half a window's gradients), and the resume ends as the
    uninterrupted run does."""
    overrides = [*OVERRIDES, "trainer.max_steps=4", "trainer.accumulate_grad_batches=2"]
    reference, reference_losses = tmp_path / "reference", Losses()
    expected = run_finetune(compose_cfg(overrides), reference, extra_callbacks=[reference_losses])

    out = tmp_path / "run"
    cfg = compose_cfg(overrides)
    stopped = SignalAtBatch(signal.SIGTERM, at=2)  # during micro-batch 2, the first of step 2's window
    with pytest.raises(Preempted):
        run_finetune(cfg, out, extra_callbacks=[stopped])
    assert _step(out / "checkpoints" / "last.ckpt") == 2 and len(stopped.losses) == 4  # the window completed

    cfg.resume = str(out)
    resumed = Losses()
    summary = run_finetune(cfg, out, extra_callbacks=[resumed])
    assert stopped.losses + resumed.losses == reference_losses.losses
    assert summary["steps"] == expected["steps"] == 4 and summary["final_metrics"] == expected["final_metrics"]
    a, b = _adapter(out), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
