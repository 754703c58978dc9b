"""Fault injection: a full disk, interrupted writes, damaged or odd inputs, bad configuration values. Each
gets a clear message before any work, nothing half-written, and the previous version of every file intact."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _recipes_utils import FAST, compose_cfg, one_thread, write_cls, write_qa  # noqa: F401
from lcsb_lightning.recipes.checkpointing import AtomicCheckpointIO
from lcsb_lightning.atomic_files import atomic_write_json
from lcsb_lightning.recipes.outputs import save_adapter
from lcsb_lightning.recipes.train import run_finetune


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


# ------------------------------------------------------------------------------- full disk
def test_full_disk_while_writing_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)

    def partial_then_full(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        handle.write(b"half a checkpoint")
        _enospc()

    monkeypatch.setattr(torch, "save", partial_then_full)
    with pytest.raises(OSError, match=f"could not write the checkpoint {path}: the disk is full; the previous"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # the temporary file is gone
    assert torch.load(path, weights_only=False)["global_step"] == 1  # the previous checkpoint is intact


def test_full_disk_while_writing_an_offload_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.mebp._internal.offload import MmapOffload

    class FullDisk:
        def tofile(self, handle: Any) -> None:
            handle.write(b"partial")
            _enospc()

    offload = MmapOffload(str(tmp_path), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "numpy", lambda self: FullDisk())
    with pytest.raises(OSError, match=r"QuantizedMeBP could not write the offload file .*/0\.bin \(16384 bytes\): the disk is full"):
        with offload.hooks():
            (x * x).sum()
    assert offload.files() == []  # the partial file is removed
    offload.close()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- interrupted writes
def _tiny_peft() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))


def test_interrupted_adapter_save_leaves_the_previous_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import PeftModel

    model = _tiny_peft()
    path = tmp_path / "adapter"
    save_adapter(model, path)
    first = (path / "adapter_model.safetensors").read_bytes()
    original = type(model).save_pretrained

    def interrupted(self: Any, folder: str, **kwargs: Any) -> None:
        original(self, folder, **kwargs)
        Path(folder, "adapter_model.safetensors").write_bytes(b"half")  # killed mid-write
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", interrupted)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(model, path)
    monkeypatch.undo()
    assert (path / "adapter_model.safetensors").read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # the half-written folder is gone
    PeftModel.from_pretrained(_tiny_peft().get_base_model(), str(path))  # and it loads
    save_adapter(model, path)  # a later save replaces it and removes the previous folder
    assert (path / "adapter_model.safetensors").read_bytes() != first and [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_interrupted_summary_write_leaves_the_previous_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"steps": 1})

    def boom(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_json(path, {"steps": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"steps": 1} and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# ---------------------------------------------------------------------------------- bad input
def _assert_nothing_written(out: Path) -> None:
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize(("content", "match"), [
    (b"", r"train.txt is empty"),
    (b"\xff\xfe caf\xe9 au lait", r"train.txt is not UTF-8 text \(byte 0"),
])
def test_bad_text_files(tmp_path: Path, content: bytes, match: str) -> None:
    train = tmp_path / "train.txt"
    train.write_bytes(content)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        run_finetune(compose_cfg([*FAST, "task=lm_text", f"task.train_files=[{train}]"]), out)
    _assert_nothing_written(out)


def test_every_example_longer_than_seq_len(tmp_path: Path) -> None:
    train, evals = write_qa(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"no train example fits seq_len=8 \(18 prompts were too long\)"):
        run_finetune(compose_cfg([*FAST, "task=qa_jsonl", f"task.train_file={train}", f"task.eval_file={evals}", "seq_len=8"]), out)
    _assert_nothing_written(out)


def test_empty_table_and_label_missing_from_the_verbalizer(tmp_path: Path) -> None:
    train, evals = write_cls(tmp_path)
    base = ["task=classification", f"task.train_file={train}", f"task.eval_file={evals}", "task.text_column=sentence"]
    out = tmp_path / "run"
    with pytest.raises(KeyError, match=r"label\(s\) \['1'\] in .*train.tsv are not in the verbalizer"):
        run_finetune(compose_cfg([*FAST, *base, "task.verbalizer={0: bad}"]), out)
    evals.write_text("sentence\tlabel\n")
    with pytest.raises(ValueError, match=r"dev.tsv holds no rows"):
        run_finetune(compose_cfg([*FAST, *base, "task.verbalizer={0: bad, 1: good}"]), out)
    _assert_nothing_written(out)


def test_tokenizer_without_pad_and_eos_tokens() -> None:
    from lcsb_lightning.recipes.models import _finish_tokenizer

    class Bare:
        pad_token_id = eos_token_id = None

    with pytest.raises(ValueError, match="the tokenizer \\(Bare\\) has neither a pad nor an EOS token"):
        _finish_tokenizer(Bare())


# --------------------------------------------------------------------------- bad config values
@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_steps=0", "trainer.max_steps=0: allowed: an integer >= 1"),
    ("trainer.max_steps=-5", "trainer.max_steps=-5: allowed: an integer >= 1"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0: allowed: a number > 0 or null"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: allowed: an integer >= 1"),
    ("+trainer.max_step=5", "trainer.max_step: allowed: an argument of lightning.Trainer"),
    ("seq_len=1", "seq_len=1: allowed: an integer >= 2"),
    ("seq_len=100000", "seq_len=100000 is above the model's context of 512: allowed: 2..512"),
    ("batch_size=0", "batch_size=0: allowed: an integer >= 1"),
    ("eval_batch_size=0", "eval_batch_size=0: allowed: an integer >= 1"),
    ("checkpoint_every=0", "checkpoint_every=0: allowed: an integer >= 1"),
    ("module.lr=0", "module.lr=0.0: allowed: a number > 0"),
    ("module.weight_decay=-1", "module.weight_decay=-1.0: allowed: a number >= 0"),
    ("module.warmup_steps=-1", "module.warmup_steps=-1: allowed: an integer >= 0"),
    ("module.schedule=step", "module.schedule='step': allowed: cosine_with_min_lr, cosine, linear, constant_with_warmup, constant"),
    ("module.min_lr_ratio=2", r"module.min_lr_ratio=2.0: allowed: a number in \[0, 1\]"),
    ("module.chunk_size=0", "module.chunk_size=0: allowed: an integer >= 1"),
    ("policy=cyclic policy.fraction=0", r"policy: `fraction` must be in \(0, 1\], got 0"),
    ("policy=paper policy.fraction=1.5", r"policy: `fraction` must be in \(0, 1\], got 1.5"),
    ("policy=random policy.fraction=null policy.layers_per_step=0", "policy: `layers_per_step` must be an integer >= 1, got 0"),
    ("policy=dyadic policy.levels=0", "policy: `levels` must be an integer >= 1, got 0"),
    ("policy=dyadic policy.levels={5:4}", "policy: `levels` must be an integer >= 1, got {5: 4}"),
    ("policy=grad_norm policy.ema_decay=1.5", "policy: `ema_decay`"),
    ("lcsb.backward=approx", "lcsb: `backward='approx'` is not supported; allowed: identity, selected_only, all_reached"),
    ("lcsb.unreached=skip", "lcsb: `unreached='skip'` is not supported; allowed: skip_below, implicit"),
    ("lcsb.backward=truncated", "lcsb: `backward='truncated'` is not supported; allowed: identity, selected_only, all_reached"),
    ("lcsb.probe_every=-1", "lcsb: `probe_every` must be an integer >= 0, got -1"),
    ("mebp=int4 mebp.fmt=q4_k", "mebp: `fmt='q4_k'` is not supported; choose one of 'auto', 'int4', 'int4_asym', 'nf4', 'fp4'"),
    ("mebp=int4 mebp.weights=disk", "mebp: `weights='disk'` is not supported; choose one of 'auto', 'mmap', 'ram'"),
    ("guard.action=retry", "guard: `action='retry'` is not supported; allowed: skip, rollback, stop"),
    ("guard=stop guard.spike_factor=0.5", "guard: `spike_factor` must be > 1, got 0.5"),
    ("best_adapter_mode=lowest", r"best_adapter: BestAdapter\(mode='lowest'\): allowed: 'min', 'max'"),
    ("early_stopping_patience=0", "early_stopping_patience=0: allowed: an integer >= 1"),
    ("keep_activations=0", "keep_activations=0: allowed: an integer >= 1"),
    ("early_stopping_patience=2 best_adapter=null", "early_stopping_patience=2 watches best_adapter's metric, and "
     "best_adapter is null"),
    # a policy node of the old shape (the callback itself, as a saved run config or a user config of 0.4 has it)
    ("policy=full policy._target_=lcsb_lightning.callback.LCSBCallback", "policy: lcsb_lightning.callback.LCSBCallback is not a "
     "SelectionPolicy; allowed: a lcsb_lightning.policies class"),
])
def test_bad_configuration_values_fail_before_anything_runs(tmp_path: Path, override: str, message: str) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=f"invalid configuration: .*{message}"):
        run_finetune(compose_cfg([*FAST, "task=pydoc", *override.split()]), out)
    _assert_nothing_written(out)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_init_adapter_is_refused_before_any_training(tmp_path: Path, damage: str) -> None:
    model = _tiny_peft()
    adapter = tmp_path / "adapter"
    save_adapter(model, adapter)
    weights = adapter / "adapter_model.safetensors"
    if damage == "missing":
        weights.unlink()
        error, match = FileNotFoundError, "adapter_model.safetensors is missing"
    else:
        weights.write_bytes(weights.read_bytes()[:40])
        error, match = ValueError, "the adapter is truncated or corrupted"
    out = tmp_path / "run"
    with pytest.raises(error, match=match):
        run_finetune(compose_cfg([*FAST, "task=pydoc", f"module.init_adapter={adapter}"]), out)
    _assert_nothing_written(out)


def test_training_continues_from_an_adapter(tmp_path: Path) -> None:
    first = run_finetune(compose_cfg([*FAST, "task=pydoc", "task.max_eval_examples=2", "module.lr=1e-2"]), tmp_path / "a")
    second = run_finetune(compose_cfg([*FAST, "task=pydoc", "task.max_eval_examples=2", "module.lr=1e-2",
                                       f"module.init_adapter={tmp_path / 'a' / 'adapter'}"]), tmp_path / "b")
    assert second["initial_metrics"]["val/loss"] == pytest.approx(first["final_metrics"]["val/loss"], abs=1e-5)
