"""``CausalLMModule``: LoRA fine-tuning of a Hugging Face causal LM with task-aware evaluation."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from lightning import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lcsb_lightning.peft_without_bnb import peft_without_bitsandbytes
from lcsb_lightning.recipes.batching import IGNORE
from lcsb_lightning.recipes.metrics import ExactMatch, LanguageModelMetrics
from lcsb_lightning.recipes.tasks import ClassificationTask, QAJsonlTask, Task, extract_number


def check_adapter(path: str) -> None:
    """Raise a ``ValueError`` naming the file when ``path`` is not a complete, readable peft adapter folder."""
    import json
    from pathlib import Path

    folder = Path(path)
    config, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for required in (config, weights):
        if not required.is_file():
            raise FileNotFoundError(f"init_adapter={path!r}: {required} is missing (expected a peft adapter folder)")
    try:
        json.loads(config.read_text())
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as handle:
            for key in handle.keys():
                handle.get_tensor(key)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ValueError(f"init_adapter={path!r}: {type(exc).__name__} reading it ({exc}); the adapter is truncated "
                         "or corrupted") from exc


def rng_states() -> dict[str, Any]:
    """The random states of torch (CPU, CUDA), Python and numpy: a resumed run draws what an unbroken one would."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": _numpy_state(),
    }


def _numpy_state() -> tuple[str, torch.Tensor, int, int, float]:
    # numpy's key as a tensor: a checkpoint must load with torch.load(weights_only=True), which refuses ndarrays
    name, key, pos, has_gauss, cached = np.random.get_state()
    return str(name), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore :func:`rng_states` (those present; CUDA states on the devices present, in order)."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        name, key, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = list(states.get("cuda", []))
    if cuda and torch.cuda.is_available():
        for device, state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)


class CausalLMModule(LightningModule):
    """LoRA fine-tuning of a causal LM, evaluated with the task's metrics.

    Evaluation reports ``val/loss``, ``val/ppl`` and ``val/token_acc`` on the target tokens; QA adds
    ``val/exact_match`` (greedy generations on the first ``num_generate`` examples) and classification
    ``val/accuracy`` (the verbalizer word with the highest log-likelihood).

    Args:
        model: A Hugging Face causal LM.
        tokenizer: Its tokenizer (used for generation and the verbalizer).
        task: The task (gives the evaluation kind and its settings).
        lora: A ``peft.LoraConfig``; None trains the model as given (it must already have trainable parameters).
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: Linear warm-up steps.
        schedule: A ``transformers.get_scheduler`` name: ``cosine_with_min_lr`` (decays to
            ``min_lr_ratio`` of the peak), ``cosine``, ``linear``, ``constant_with_warmup`` or ``constant``.
        min_lr_ratio: Final learning-rate multiplier of ``cosine_with_min_lr``.
        chunked_loss: Compute the training loss with ``lcsb_lightning.mebp.chunked_lm_loss`` (no full logits).
        chunk_size: Sequence chunk of the chunked loss.
        init_adapter: A peft adapter folder to continue training from (instead of a fresh ``lora``).
    """

    #: Read by Lightning's ``ThroughputMonitor`` (not computed here: it logs batches, samples and tokens per second).
    flops_per_batch: int | None = None

    def __init__(self, model: nn.Module, tokenizer: Any, task: Task, lora: Any | None = None, lr: float = 1e-4,
                 weight_decay: float = 0.01, betas: Sequence[float] = (0.9, 0.999), warmup_steps: int = 0,
                 schedule: str = "cosine_with_min_lr", min_lr_ratio: float = 0.0, chunked_loss: bool = False,
                 chunk_size: int = 64, init_adapter: str | None = None):
        super().__init__()
        self.save_hyperparameters(ignore=["model", "tokenizer", "task", "lora"])
        if init_adapter is not None:
            from peft import PeftModel

            check_adapter(init_adapter)
            with peft_without_bitsandbytes():
                model = PeftModel.from_pretrained(model, init_adapter, is_trainable=True)
        elif lora is not None:
            from peft import get_peft_model

            with peft_without_bitsandbytes():
                model = get_peft_model(model, lora)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no trainable parameter; configure lora:")
        self.model = model.train()  # from_pretrained returns eval mode; Lightning restores modes per loop
        #: Names of the tensors the run trains (the adapter's), read once: a checkpoint keeps them all, also those a
        #: callback stops training for a while (ProgressiveFreezing's frozen blocks).
        self.trained_keys = frozenset(name for name, p in self.named_parameters() if p.requires_grad)
        # Checkpoints hold the trainable parameters only (see on_save_checkpoint): the frozen base weights
        # come from the model source, compressed or not, so loading is not strict about them.
        self.strict_loading = False
        self.tokenizer, self.task = tokenizer, task
        self.kind = task.kind
        self.val_lm = LanguageModelMetrics()
        self.val_em = ExactMatch()
        #: Whether evaluation runs the greedy generations of exact match (the benchmark's mid-run evaluations skip them).
        self.generate = True
        self._generated = 0
        self.verbalizer: list[list[int]] = []
        self._logit_kwargs: dict[str, float | None] | None = None  # the model's logit transform, read once
        if isinstance(task, ClassificationTask):
            self.verbalizer = task.verbalizer_ids(tokenizer)
            self.val_acc = MulticlassAccuracy(num_classes=len(self.verbalizer), average="micro")

    # ------------------------------------------------------------------------------------- loss
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the causal LM."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _hidden_and_head(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, nn.Module, dict[str, float | None]]:
        """Final-norm hidden states (no logits), the LM head and the model's logit transform."""
        from lcsb_lightning.mebp import logit_transform

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        backbone = getattr(base, base.base_model_prefix)  # e.g. LlamaModel
        hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          use_cache=False).last_hidden_state
        if self._logit_kwargs is None:
            self._logit_kwargs = logit_transform(base)
        return hidden, base.get_output_embeddings(), self._logit_kwargs

    def _loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        if not self.hparams.chunked_loss:
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"], use_cache=False).loss
        from lcsb_lightning.mebp import chunked_lm_loss

        hidden, head, transform = self._hidden_and_head(batch)
        return chunked_lm_loss(hidden, head, batch["labels"], chunk_size=self.hparams.chunk_size, **transform)

    @torch.no_grad()
    def _update_lm_metrics(self, batch: Mapping[str, Any]) -> None:
        """The LM metrics of one batch, streamed over the vocabulary: full logits of 4 x 256 x 49k would be 200 MB."""
        from lcsb_lightning.mebp.loss import lm_head_predictions

        hidden, head, transform = self._hidden_and_head(batch)
        target = batch["labels"][:, 1:]
        nll, best = lm_head_predictions(hidden[:, :-1].reshape(-1, hidden.shape[-1]), head, target.reshape(-1),
                                        transform["logit_scale"] or 1.0, transform["logit_softcap"], IGNORE)
        self.val_lm.update(None, batch["labels"], nll=nll, predicted=best)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """One LoRA training step; logs ``train/loss`` and ``train/lr``."""
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch["input_ids"].size(0))
        if self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True)
        return loss

    # ------------------------------------------------------------------------------- evaluation
    def on_validation_epoch_start(self) -> None:
        """Reset the per-epoch generation budget."""
        self._generated = 0

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        """Accumulate the LM metrics and the task's own metric for one batch."""
        self._update_lm_metrics(batch)
        if self.kind == "classification":
            self.val_acc.update(self._classify(batch), torch.tensor(batch["label"], device=self.device))
        elif self.kind == "qa" and isinstance(self.task, QAJsonlTask):
            budget = (self.task.num_generate if self.generate else 0) - self._generated
            if budget > 0:
                prompts, refs = batch["prompt_ids"][:budget], batch["answer"][:budget]
                preds = [extract_number(self.generate_text(p), self.task.answer_regex) for p in prompts]
                self.val_em.update(preds, refs)
                self._generated += len(prompts)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss``, ``val/ppl``, ``val/token_acc`` and ``val/accuracy`` or ``val/exact_match``."""
        for key, value in self.val_lm.compute().items():
            self.log(f"val/{key}", value, prog_bar=key == "loss")
        self.val_lm.reset()
        if self.kind == "classification":
            self.log("val/accuracy", self.val_acc.compute())
            self.val_acc.reset()
        elif self.kind == "qa" and int(self.val_em.total) > 0:
            self.log("val/exact_match", self.val_em.compute())
            self.val_em.reset()

    @torch.no_grad()
    def _classify(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Index of the verbalizer word with the highest total log-likelihood after each prompt."""
        prompts: list[list[int]] = batch["prompt_ids"]
        pad = self.tokenizer.pad_token_id
        seqs = [p + w for p in prompts for w in self.verbalizer]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        target = torch.full_like(ids, IGNORE)
        for i, (p, s) in enumerate(zip([p for p in prompts for _ in self.verbalizer], seqs)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            target[i, len(p) : len(s)] = torch.tensor(s[len(p) :])
        logp = torch.log_softmax(self(ids, mask)[:, :-1].float(), dim=-1)
        tgt = target[:, 1:]
        tok = logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (tgt != IGNORE)
        return tok.sum(-1).view(len(prompts), len(self.verbalizer)).argmax(-1)

    @torch.no_grad()
    def generate_text(self, prompt_ids: list[int]) -> str:
        """Greedy continuation of one prompt (the task's ``max_new_tokens``), decoded."""
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                                  max_new_tokens=getattr(self.task, "max_new_tokens", 64),
                                  pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id)
        return self.tokenizer.decode(out[0, len(prompt_ids) :], skip_special_tokens=True)

    # ----------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the trained (LoRA) tensors only, and the RNG states: a LoRA-sized, resumable checkpoint."""
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in self.trained_keys}
        checkpoint["rng_states"] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint that lacks a trainable tensor of this model (a different LoRA configuration)."""
        missing = sorted(self.trained_keys - set(checkpoint.get("state_dict", {})))
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} trainable tensors of this model (e.g. "
                             f"{', '.join(missing[:3])}): it was written with another model or LoRA configuration")
        states = checkpoint.get("rng_states")
        if states:
            set_rng_states(states)

    # ------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over every trainable parameter, with warm-up and the configured decay per step."""
        from transformers import get_scheduler

        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay,
                                betas=tuple(self.hparams.betas))
        name = self.hparams.schedule
        sched = get_scheduler(name, opt, num_warmup_steps=self.hparams.warmup_steps,
                              num_training_steps=int(self.trainer.estimated_stepping_batches),
                              scheduler_specific_kwargs={"min_lr_rate": self.hparams.min_lr_ratio}
                              if name == "cosine_with_min_lr" else None)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
