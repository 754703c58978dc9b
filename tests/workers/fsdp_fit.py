"""LCSB under FSDP with the model built in ``configure_model`` (run by ``tests/test_fsdp.py``).

``python tests/workers/fsdp_fit.py OUT STRATEGY POLICY STEPS [ACCELERATOR]`` with STRATEGY ``fsdp2``
(``ModelParallelStrategy`` + ``fully_shard``), ``fsdp1`` (``FSDPStrategy(use_orig_params=True)``, CUDA
only in Lightning) or ``single`` (one process, the reference). Every rank writes ``<OUT>/rank<r>.json`` and, in
``<OUT>/grad_norm_collectives_<r>.json``, the number of all-reduces each ``grad_norms`` call made.
"""

from __future__ import annotations

import json
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


class CollectiveCounter:
    """Counts the all-reduces (plain and functional, as DTensor's ``full_tensor`` makes them) inside
    each ``grad_norms`` call of the LCSB controller."""

    def __init__(self) -> None:
        self.per_call: list[int] = []
        self.inside = False

    def install(self) -> None:
        import torch.distributed._functional_collectives as funcol

        import lcsb_lightning.controller as controller

        for owner, name in ((torch.distributed, "all_reduce"), (funcol, "all_reduce")):
            setattr(owner, name, self._counted(getattr(owner, name)))
        grad_norms = controller.grad_norms

        def counted_grad_norms(*args: Any, **kwargs: Any) -> Any:
            self.per_call.append(0)
            self.inside = True
            try:
                return grad_norms(*args, **kwargs)
            finally:
                self.inside = False

        controller.grad_norms = counted_grad_norms  # type: ignore[assignment]

    def _counted(self, collective: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                self.per_call[-1] += 1
            return collective(*args, **kwargs)

        return counted


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
    counter = CollectiveCounter()
    counter.install()
    module = ShardedLM(strategy_name)
    lcsb = LCSBCallback(policy, layers_per_step=1, seed=3, log_every_n_steps=0)
    record = Record(lcsb)
    trainer = Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[lcsb, record], use_distributed_sampler=False)
    trainer.fit(module, strided_loader(4 // devices))
    write_rank(out, trainer, module, lcsb, record)
    (out / f"grad_norm_collectives_{trainer.global_rank}.json").write_text(json.dumps(counter.per_call))


if __name__ == "__main__":
    main()
