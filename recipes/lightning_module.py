# python recipes/lightning_module.py [--steps 40] [--tiny]
"""LCSB and QuantizedMeBP in your own LightningModule: copy this file and edit it.

Fine-tunes LoRA adapters of SmolLM2-135M-Instruct on Python's own documentation text, with

* ``LCSBCallback("dyadic", backward="selected_only")``: each step back-propagates only the top blocks (all of
  them every 8th step), with exact gradients; and
* ``QuantizedMeBP(fmt="int4")``: the frozen weights stay 4-bit and every block is recomputed in backward.

Nothing here is specific to lcsb_lightning's recipes: any LightningModule whose model has LoRA-adapted
transformer blocks works the same way. ``--tiny`` swaps in a small random Llama (a smoke test in seconds).
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

from lcsb_lightning import LCSBCallback, QuantizedMeBP


class LoRALanguageModel(LightningModule):
    def __init__(self, base: torch.nn.Module, lr: float = 5e-4) -> None:
        super().__init__()
        self.model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Built from every trainable parameter, as usual: LCSB never changes requires_grad or param groups.
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


def load(tiny: bool) -> tuple[torch.nn.Module, list[list[int]]]:
    """The model and token sequences of 128 tokens of Python's documentation."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2)
        ids = list(text.encode("utf-8"))
        model = LlamaForCausalLM(config)
    else:
        from lcsb_lightning.recipes.models import smollm2_135m  # the hub model, else the offline GGUF

        bundle = smollm2_135m()
        model, ids = bundle.model, bundle.tokenizer(text, add_special_tokens=False).input_ids
    return model, [ids[i : i + 128] for i in range(0, len(ids) - 128, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    args = parser.parse_args()
    torch.manual_seed(0)
    base, sequences = load(args.tiny)
    loader = DataLoader(torch.tensor(sequences), batch_size=2, shuffle=True)
    trainer = Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        plugins=[QuantizedMeBP(fmt="int4", group_size=32 if args.tiny else 64)],
        callbacks=[LCSBCallback("dyadic", backward="selected_only")],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LoRALanguageModel(base), loader)


if __name__ == "__main__":
    main()
