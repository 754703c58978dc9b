"""The Hydra entry points as a user runs them: a two-job multirun, and an unknown option."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _recipes_utils import FAST, write_text

def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def test_two_job_multirun_writes_two_summaries(tmp_path: Path) -> None:
    train, evals = write_text(tmp_path)
    sweep = tmp_path / "sweep"
    script = shutil.which("lcsb-finetune")  # the console script when installed, else the same entry point
    entry = [script] if script else [sys.executable, "-m", "lcsb_lightning.recipes.cli"]
    cmd = [
        *entry, "--multirun", *FAST, "task=lm_text",
        f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "policy=full,cyclic", f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 2
    policies = [json.loads(p.read_text())["choices"]["policy"] for p in summaries]
    assert sorted(policies) == ["cyclic", "full"]
    for path in summaries:
        assert (path.parent / "adapter" / "adapter_config.json").is_file()
        assert list((path.parent / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_option_exits_with_the_available_options(tmp_path: Path) -> None:
    script = shutil.which("lcsb-finetune") or str(Path(sys.executable).parent / "lcsb-finetune")
    cmd = [script, "policy=cycle", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cyclic" in proc.stderr and "grad_norm" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()
