"""``lcsb-finetune trainer=ddp``: two CPU processes (gloo) through the console script, each reading its share of
the seeded per-epoch permutation; a run killed after a checkpoint resumes to exactly the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _recipes_utils import FINETUNE, checkpoint_step, finetune_env, run_finetune_cli

EXAMPLES = 20  # 10 batches of 2 an epoch on one process, 5 per rank on two
BASE = ["trainer=ddp", "model=tiny", "task=pydoc", "seq_len=32", f"task.max_train_examples={EXAMPLES}",
        "task.max_eval_examples=4", "trainer.val_check_interval=20", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "lcsb.log_every_n_steps=0", "module.lr=1e-2"]


def _checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _losses(run_dir: Path) -> dict[int, float]:
    """Rank 0's ``train/loss`` per step; a resumed run's later event files replace the steps it re-ran."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    losses: dict[int, float] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "train/loss":
                    losses[event.step] = float(torch.frombuffer(bytearray(value.tensor.tensor_content), dtype=torch.float32)[0]
                                               if value.tensor.tensor_content else value.tensor.float_val[0])
    return losses


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("stop", ["SIGKILL", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_stopped_ddp_run_resumes_to_the_uninterrupted_result(tmp_path: Path, stop: str) -> None:
    """SIGKILL to both processes after a checkpoint, or SIGTERM to the first (Lightning passes it on): the
    preemption checkpoint of that step, exit status 143."""
    steps = 40
    overrides = [*BASE, f"trainer.max_steps={steps}", "checkpoint_every=5"]
    started = time.perf_counter()
    reference = tmp_path / "reference"
    done = run_finetune_cli(reference, *overrides, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reference_seconds = time.perf_counter() - started

    killed = tmp_path / "killed"
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen([FINETUNE, *overrides, f"hydra.run.dir={killed}"], cwd=tmp_path, env=finetune_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    last = killed / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while checkpoint_step(last) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
    if stop == "SIGKILL":
        os.killpg(proc.pid, signal.SIGKILL)  # both ranks: the second is a child of the first, in its process group
    else:
        os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=300)
    log.close()
    assert code == (-signal.SIGKILL if stop == "SIGKILL" else 143), (tmp_path / "killed.log").read_text()[-4000:]
    step = checkpoint_step(last)
    assert 5 <= step < steps and not (killed / "summary.json").exists(), "the run was not killed mid-way"

    started = time.perf_counter()
    resumed = run_finetune_cli(killed, f"resume={killed}", timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    resumed_seconds = time.perf_counter() - started
    ours, theirs = json.loads((killed / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert ours["resumed_from"].endswith("last.ckpt") and ours["steps"] == theirs["steps"] == steps
    assert ours["final_metrics"] == theirs["final_metrics"] and ours["initial_metrics"] == theirs["initial_metrics"]
    assert ours["block_selection_counts"] == theirs["block_selection_counts"]
    assert theirs["config"]["trainer"]["strategy"] == "ddp" and theirs["config"]["trainer"]["devices"] == 2
    assert (reference / "train_ddp_process_1.log").is_file()  # the second rank ran
    (loader,) = _checkpoint(reference / "checkpoints" / "last.ckpt")["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # Each rank reads half of the 20 examples (Lightning's DistributedSampler): 5 batches an epoch, so the 40 steps
    # ended epoch 7 (one process: epoch 3); the run was killed at the end of epoch 0 or later
    assert loader["sampler_epoch"] == 7
    losses, reference_losses = _losses(killed), _losses(reference)
    assert len(reference_losses) == steps and losses == reference_losses
    a, b = _adapter(killed), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"{stop} at step {step}; reference {reference_seconds:.1f} s, resume {resumed_seconds:.1f} s; "
          f"max |adapter diff| {max(float((a[k] - b[k]).abs().max()) for k in a):.3g}")


def test_ranks_that_loaded_different_weights_are_refused(tmp_path: Path) -> None:
    """What ``model.source=auto`` can do under DDP (one rank gets the hub's weights, another the GGUF's), made
    certain: each rank initialises the tiny model with its own seed. The run stops before training, naming why."""
    run = tmp_path / "run"
    done = run_finetune_cli(run, *BASE, "trainer.max_steps=2", "model.seed='${oc.env:LOCAL_RANK,0}'", timeout=600)
    assert done.returncode != 0, (done.stdout + done.stderr)[-3000:]
    assert "did not load the same model weights" in done.stderr and "model.source" in done.stderr, done.stderr[-3000:]
    assert not (run / "summary.json").exists()
