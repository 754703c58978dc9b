"""One LCSB fit under ``Trainer(strategy=...)`` on CPU; every rank writes what it saw to ``<out>/rank<r>.json``.

Run by ``tests/test_ddp.py`` as ``python tests/workers/ddp_fit.py OUT JOB [JOB ...]`` where each JOB is
``name:policy:steps[:backward[:ckpt_every|resume_from_job|ragged]]``; the jobs run one after the other in the
same processes (one process group). Lightning's launcher re-runs this script for the other ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lcsb_lightning import LCSBCallback  # noqa: E402
from tests.conftest import TokenLM, tiny_llama_peft  # noqa: E402
from tests.workers.common import Record, strided_loader, write_rank  # noqa: E402


def fit(out: Path, name: str, policy: str, steps: int, backward: str, extra: str, devices: int, strategy: str) -> None:
    torch.manual_seed(0)
    module = TokenLM(tiny_llama_peft(num_layers=4), lr=5e-3)
    lcsb = LCSBCallback(policy, layers_per_step=1, backward=backward, seed=3, log_every_n_steps=0)
    record = Record(lcsb)
    callbacks: list[Callback] = [lcsb, record]
    ckpt_every, ragged = int(extra) if extra.isdigit() else 0, extra == "ragged"
    resume = str(out / extra / "last.ckpt") if extra and not extra.isdigit() and not ragged else None
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=out / name, save_last=True, every_n_train_steps=ckpt_every))
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=bool(ckpt_every), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, use_distributed_sampler=False,
    )
    # The same 32 sequences whatever the world size: a global batch of 4, so 8 steps per epoch
    trainer.fit(module, strided_loader(4 // devices, ragged), ckpt_path=resume)
    write_rank(out / name, trainer, module, lcsb, record)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("jobs", nargs="+")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    for job in args.jobs:
        name, policy, steps, *rest = job.split(":")
        backward = rest[0] if rest else "identity"
        fit(args.out, name, policy, int(steps), backward, rest[1] if len(rest) > 1 else "", args.devices, args.strategy)


if __name__ == "__main__":
    main()
