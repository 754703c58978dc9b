"""LCSB and ``DivergenceGuard`` under ``Trainer(strategy="ddp")`` on CPU with a fault on rank 1 only.

Run by ``tests/test_guard_ddp.py`` as ``python tests/workers/guard_fit.py OUT JOB [JOB ...]``, each JOB
``name:action:fault`` (fault ``nan``: the loss of rank 1 reads NaN at step ``BAD_STEP`` while its gradient
stays finite, the case the gradient all-reduce does not spread; ``spike``: rank 1's loss is 100 times too
large there). Every rank writes ``<out>/<name>/rank<r>.json``. Lightning's launcher re-runs this script
for rank 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import Callback, Trainer  # noqa: E402

from lcsb_lightning import DivergenceGuard, LCSBCallback  # noqa: E402
from tests.conftest import FaultyLM  # noqa: E402
from tests.workers.common import full_values, strided_loader  # noqa: E402

BAD_STEP = 6
STEPS = 10


class LoraAtBadStep(Callback):
    """The LoRA values just before and just after optimizer step ``BAD_STEP``."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []

    @staticmethod
    def _lora(pl_module: Any) -> list[float]:
        return [v for n, p in pl_module.named_parameters() if "lora_" in n for v in full_values(p)]

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == BAD_STEP:
            self.before = self._lora(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == BAD_STEP + 1:
            self.after = self._lora(pl_module)


def fit(out: Path, name: str, action: str, fault: str) -> None:
    torch.manual_seed(0)
    module = FaultyLM("nan_value" if fault == "nan" else "spike", at_step=BAD_STEP, rank=1)
    guard = DivergenceGuard(action=action, window=5, warmup=3, patience=1)
    witness = LoraAtBadStep()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[LCSBCallback("cyclic", layers_per_step=1, backward="selected_only", log_every_n_steps=0), guard, witness],
    )
    start = time.monotonic()
    trainer.fit(module, strided_loader(2))
    result = {
        "rank": trainer.global_rank, "global_step": trainer.global_step, "seconds": time.monotonic() - start,
        "events": guard.events, "unchanged_at_bad_step": witness.before == witness.after,
        "lora": [v for n, p in module.named_parameters() if "lora_" in n for v in full_values(p)],
        "state": guard.state_dict(),
    }
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("jobs", nargs="+")
    args = parser.parse_args()
    for job in args.jobs:
        fit(args.out, *job.split(":"))


if __name__ == "__main__":
    main()
