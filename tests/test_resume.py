"""Nothing lost: a run killed with SIGKILL after a checkpoint resumes to exactly what an uninterrupted run
gives, checkpoints are LoRA-sized, and a bad checkpoint is refused before any training."""

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

STEPS = 60
BASE = ["model=tiny", "task=pydoc", "seq_len=32", "task.max_eval_examples=4", f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=30", "trainer.log_every_n_steps=10", "trainer.enable_progress_bar=false",
        "checkpoint_every=5", "lcsb.log_every_n_steps=0", "module.lr=1e-2"]
CONFIGS = {
    "dyadic": ["policy=dyadic"],
    "cyclic": ["policy=cyclic"],
    "random": ["policy=random"],
    "grad_norm": ["policy=grad_norm"],
    "cyclic_int4": ["policy=cyclic", "mebp=int4"],
    "random_int4": ["policy=random", "mebp=int4"],
    "grad_norm_int4": ["policy=grad_norm", "mebp=int4"],
}


def _adapter(run_dir: Path, name: str = "adapter") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / name / "adapter_model.safetensors"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ("dyadic", "cyclic_int4", "grad_norm") else [pytest.mark.slow])
                                  for n in CONFIGS])
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path: Path, name: str) -> None:
    overrides = [*BASE, *CONFIGS[name]]
    reference = tmp_path / "reference"
    done = run_finetune_cli(reference, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen([FINETUNE, *overrides, f"hydra.run.dir={killed}"], cwd=tmp_path, env=finetune_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = killed / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 600
    while checkpoint_step(last) < 10 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    step = checkpoint_step(last)
    assert 10 <= step < STEPS and not (killed / "summary.json").exists(), "the run was not killed mid-way"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    (loader,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # the data position
    per_epoch = -(-json.loads((reference / "summary.json").read_text())["train_examples"] // 2)  # batch_size=2
    assert (loader["sampler_epoch"], loader["_num_yielded"]) == ((step - 1) // per_epoch, (step - 1) % per_epoch + 1)

    resumed = run_finetune_cli(killed, f"resume={killed}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours, theirs = json.loads((killed / "summary.json").read_text()), json.loads((reference / "summary.json").read_text())
    assert ours["resumed_from"].endswith("last.ckpt") and ours["steps"] == theirs["steps"] == STEPS
    assert ours["final_metrics"]["val/loss"] == theirs["final_metrics"]["val/loss"]  # bit-identical on CPU
    assert ours["initial_metrics"] == theirs["initial_metrics"]
    assert ours["block_selection_counts"] == theirs["block_selection_counts"]
    a, b = _adapter(killed), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours["best"]["step"] == theirs["best"]["step"] and ours["best"]["value"] == theirs["best"]["value"]
    a, b = _adapter(killed, "adapter_best"), _adapter(reference, "adapter_best")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_holds_the_lora_state_not_the_base_weights(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_finetune_cli(run_dir, *BASE, "trainer.max_steps=5")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(checkpoint["state_dict"])
    assert keys and all("lora_" in k for k in keys)
    assert checkpoint["global_step"] == 5 and checkpoint["optimizer_states"] and checkpoint["lr_schedulers"]
    lcsb = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("LCSBCallback"))
    assert lcsb["selected_at_step"] == 4
    assert "rng_states" in checkpoint
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]  # no half-written leftovers


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint_is_refused_before_any_training(tmp_path: Path, damage: str) -> None:
    run_dir = tmp_path / "run"
    assert run_finetune_cli(run_dir, *BASE, "trainer.max_steps=5").returncode == 0
    last = run_dir / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"not a checkpoint" * 100)
    (run_dir / "summary.json").unlink()
    done = run_finetune_cli(run_dir, f"resume={run_dir}")
    assert done.returncode != 0
    assert f"the checkpoint {last} cannot be read" in done.stderr and "truncated or corrupted" in done.stderr
    assert not (run_dir / "summary.json").exists()


def test_resume_refuses_other_overrides(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_finetune_cli(run_dir, *BASE, "trainer.max_steps=5").returncode == 0
    done = run_finetune_cli(run_dir, f"resume={run_dir}", "module.lr=1")
    assert done.returncode != 0 and "resume= continues a run with its own config" in done.stderr
