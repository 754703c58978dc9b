"""LCSB under plain ``strategy="ddp"`` with real processes (gloo on CPU), no ``find_unused_parameters``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "workers" / "ddp_fit.py"
JOBS = {
    "cyclic": "cyclic:cyclic:12",
    "random": "random:random:12",
    "grad_norm": "grad_norm:grad_norm:12",
    "cyclic_exact": "cyclic_exact:cyclic:12:selected_only",
    "first_part": "first_part:cyclic:8:identity:8",  # stops at the end of epoch 1 with a checkpoint
    "resumed": "resumed:cyclic:12:identity:first_part",
    "ragged": "ragged:grad_norm:12:all_reached:ragged",  # rank 0 reads 12 tokens a sequence, rank 1 reads 8
}


def _launch(out: Path, jobs: list[str], *extra: str) -> None:
    done = subprocess.run([sys.executable, str(WORKER), str(out), *jobs, *extra], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise AssertionError(f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp")
    _launch(out, list(JOBS.values()))
    _launch(out / "single", [JOBS["cyclic"]], "--devices", "1", "--strategy", "auto")
    runs = {name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in (0, 1)] for name in JOBS}
    runs["single"] = [json.loads((out / "single" / "cyclic" / "rank0.json").read_text())]
    return runs


@pytest.mark.parametrize("name", ["cyclic", "random", "grad_norm", "cyclic_exact", "ragged"])
def test_ranks_select_the_same_blocks_and_end_with_the_same_parameters(ddp_runs, name: str) -> None:
    rank0, rank1 = ddp_runs[name]
    assert rank0["world"] == 2 and len(rank0["selections"]) == 12
    assert rank0["selections"] == rank1["selections"]
    assert rank0["lora"] == rank1["lora"]
    assert rank0["losses"] != rank1["losses"]  # the ranks did see different data


def test_implicit_momentum_moves_skipped_blocks_as_on_one_process(ddp_runs) -> None:
    rank0 = ddp_runs["cyclic"][0]
    single = ddp_runs["single"][0]
    assert rank0["selections"][:4] == [[0], [1], [2], [3]]
    assert rank0["block0"][1] != rank0["block0"][2]  # block 0 moves while the others train
    assert rank0["selections"] == single["selections"]
    for name, values in single["lora"].items():  # a global batch of 4 on one process = 2 x 2 under DDP
        assert values == pytest.approx(rank0["lora"][name], abs=2e-5), name  # reduction order differs


def test_resumed_ddp_run_continues_exactly(ddp_runs) -> None:
    full, resumed = ddp_runs["cyclic"][0], ddp_runs["resumed"][0]
    assert resumed["selections"] == full["selections"][8:]
    assert resumed["losses"] == full["losses"][8:]
    assert resumed["lora"] == full["lora"]
    assert ddp_runs["resumed"][1]["lora"] == full["lora"]
