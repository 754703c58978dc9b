"""``DivergenceGuard`` under plain ``strategy="ddp"`` with two real processes (gloo on CPU): a fault that
only rank 1 sees is acted on by both ranks, and ``stop`` ends both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "workers" / "guard_fit.py"
BAD_STEP, STEPS = 6, 10  # as in the worker
# Two processes of the tiny model take ~20 s here; a rank left waiting in an all-reduce would wait 30 min.
TIMEOUT_S = 180


def _launch(out: Path, *jobs: str) -> dict[str, list[dict[str, Any]]]:
    try:
        done = subprocess.run([sys.executable, str(WORKER), str(out), *jobs], capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"the ranks did not finish within {TIMEOUT_S} s (one left waiting in a collective?)") from error
    if done.returncode:
        raise AssertionError(f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    names = [job.split(":")[0] for job in jobs]
    return {name: [json.loads((out / name / f"rank{r}.json").read_text()) for r in (0, 1)] for name in names}


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _launch(tmp_path_factory.mktemp("guard_ddp"), "nan:skip:nan", "spike:skip:spike")


@pytest.mark.parametrize("fault", ["nan", "spike"])
def test_a_fault_on_one_rank_is_skipped_on_both(skip_runs, fault: str) -> None:
    rank0, rank1 = skip_runs[fault]
    reason = "non-finite loss" if fault == "nan" else "loss spike"
    for rank in (rank0, rank1):
        assert [e["step"] for e in rank["events"]] == [BAD_STEP] and reason in rank["events"][0]["reason"], rank["events"]
        assert rank["unchanged_at_bad_step"] and rank["global_step"] == STEPS
    assert rank0["lora"] == rank1["lora"]  # the replicas did not drift apart
    assert rank0["state"] == rank1["state"]  # the same loss statistic on every rank


def test_stop_on_one_rank_ends_both(tmp_path: Path) -> None:
    rank0, rank1 = _launch(tmp_path, "stop:stop:nan")["stop"]
    for rank in (rank0, rank1):
        assert rank["global_step"] == BAD_STEP + 1 and rank["unchanged_at_bad_step"]
        assert [e["step"] for e in rank["events"]] == [BAD_STEP]
    assert rank0["lora"] == rank1["lora"]
