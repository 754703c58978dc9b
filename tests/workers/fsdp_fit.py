"""LCSB under FSDP with the model built in ``configure_model`` (run by ``tests/test_fsdp.py``).

``python tests/workers/fsdp_fit.py OUT STRATEGY POLICY STEPS [ACCELERATOR]`` with STRATEGY ``fsdp2``
(``ModelParallelStrategy`` + ``fully_shard``), ``fsdp1`` (``FSDPStrategy(use_orig_params=True)``, CUDA
only in Lightning) or ``single`` (one process, the reference). Every rank writes ``<OUT>/rank<r>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import Trainer  # noqa: E402

from lcsb_lightning import LCSBCallback  # noqa: E402
from tests.conftest import TokenLM, tiny_llama_peft  # noqa: E402
from tests.workers.common import Record, strided_loader, write_rank  # noqa: E402


class ShardedLM(TokenLM):
    def __init__(self, sharding: str) -> None:
        super().__init__(model=torch.nn.Identity(), lr=5e-3)
        self.model = None  # type: ignore[assignment]
        self.sharding = sharding

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = tiny_llama_peft(num_layers=4)
        if self.sharding == "fsdp2":  # Lightning's FSDPStrategy wraps by itself (auto_wrap_policy)
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.get_base_model().model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


def main() -> None:
    out, strategy_name, policy, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    accelerator = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    torch.manual_seed(0)
    devices = 2
    strategy: Any = "auto"
    if strategy_name == "single":
        devices = 1
    elif strategy_name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True)
    module = ShardedLM(strategy_name)
    lcsb = LCSBCallback(policy, layers_per_step=1, seed=3, log_every_n_steps=0)
    record = Record(lcsb)
    trainer = Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[lcsb, record], use_distributed_sampler=False)
    trainer.fit(module, strided_loader(4 // devices))
    write_rank(out, trainer, module, lcsb, record)


if __name__ == "__main__":
    main()
