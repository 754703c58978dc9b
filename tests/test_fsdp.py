"""LCSB under Lightning's FSDP with the model built in ``configure_model``.

``ModelParallelStrategy`` + ``fully_shard`` (FSDP2) runs on CPU with gloo, so it is tested here on every
machine. Lightning's ``FSDPStrategy`` (FSDP1) requires CUDA: its test runs where two GPUs are present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "fsdp_fit.py"


def _run(out: Path, strategy: str, policy: str, steps: int, accelerator: str = "cpu") -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, str(WORKER), str(out), strategy, policy, str(steps), accelerator],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise AssertionError(f"worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def _assert_matches_one_process(ranks: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert len(ranks) == 2
    assert ranks[0]["selections"] == ranks[1]["selections"] == single["selections"]
    assert ranks[0]["lora"] == ranks[1]["lora"]
    for name, values in single["lora"].items():
        assert values == pytest.approx(ranks[0]["lora"][name], abs=2e-5), name


@pytest.mark.parametrize("policy", ["cyclic", "grad_norm"])
def test_fsdp2_model_parallel_strategy_on_cpu(tmp_path: Path, policy: str) -> None:
    sharded = _run(tmp_path / "fsdp2", "fsdp2", policy, 8)
    single = _run(tmp_path / "single", "single", policy, 8)[0]
    _assert_matches_one_process(sharded, single)
    if policy == "grad_norm":  # one reduction for all selected blocks, not one per LoRA parameter
        for rank in (0, 1):
            calls = json.loads((tmp_path / "fsdp2" / f"grad_norm_collectives_{rank}.json").read_text())
            assert calls == [1] * 8, calls
        assert json.loads((tmp_path / "single" / "grad_norm_collectives_0.json").read_text()) == [0] * 8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="Lightning's FSDPStrategy needs CUDA; this machine has fewer than 2 GPUs")
def test_fsdp1_use_orig_params_on_gpus(tmp_path: Path) -> None:
    sharded = _run(tmp_path / "fsdp1", "fsdp1", "cyclic", 8, accelerator="cuda")
    single = _run(tmp_path / "single", "single", "cyclic", 8)[0]
    _assert_matches_one_process(sharded, single)
