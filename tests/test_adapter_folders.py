"""A run's adapter folders are real folders with the umask's permissions: they copy (``shutil.copytree``,
``tar``) and the copy loads; each save replaces the folder whole, and a failed one leaves the previous."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lcsb_lightning.recipes.checkpointing import AtomicCheckpointIO
from lcsb_lightning.atomic_files import atomic_write_json
from lcsb_lightning.recipes.outputs import save_adapter


def _tiny_peft(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))


def _lora(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _assert_loads_as(folder: Path, model: Any) -> None:
    loaded = PeftModel.from_pretrained(_tiny_peft(seed=1).get_base_model(), str(folder))
    expected = _lora(model)
    assert expected and _lora(loaded).keys() == expected.keys()
    for name, tensor in _lora(loaded).items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _copy_with_tar(adapter: Path, destination: Path) -> Path:
    archive = destination / "a.tgz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(adapter.parent), adapter.name], check=True)
    subprocess.run(["tar", "xzf", str(archive), "-C", str(destination)], check=True)
    return destination / adapter.name


def _copy_with_cp(adapter: Path, destination: Path) -> Path:
    subprocess.run(["cp", "-r", str(adapter), str(destination)], check=True)
    return destination / adapter.name


def _copy_the_run_with_copytree(adapter: Path, destination: Path) -> Path:
    return Path(shutil.copytree(adapter.parent, destination / "run", symlinks=True)) / adapter.name


@pytest.mark.parametrize("copy", [_copy_with_tar, _copy_with_cp, _copy_the_run_with_copytree],
                         ids=["tar", "cp-r", "copytree"])
def test_a_copy_of_the_adapter_folder_loads(tmp_path: Path, umask_022: None, copy: Any) -> None:
    model = _tiny_peft()
    path = save_adapter(model, tmp_path / "run" / "adapter")
    (tmp_path / "elsewhere").mkdir()
    copied = copy(path, tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "run")  # the copy holds the files themselves
    assert copied.is_dir() and not copied.is_symlink()
    _assert_loads_as(copied, model)


def test_the_outputs_get_the_umask_permissions(tmp_path: Path, umask_022: None) -> None:
    adapter = save_adapter(_tiny_peft(), tmp_path / "adapter")
    assert not adapter.is_symlink() and stat.S_IMODE(adapter.stat().st_mode) == 0o755
    files = list(adapter.iterdir())
    assert files and {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o644 for f in files}
    summary = atomic_write_json(tmp_path / "summary.json", {"steps": 1})
    checkpoint = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, checkpoint)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (summary, checkpoint)} == {0o644}


def test_a_save_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    model = _tiny_peft()
    path = tmp_path / "adapter"
    save_adapter(model, path)
    (path / "stale.txt").write_text("from the previous save")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1.0)
    save_adapter(model, path)
    _assert_loads_as(path, model)
    assert not (path / "stale.txt").exists() and [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_a_link_of_an_older_version_becomes_a_real_folder(tmp_path: Path) -> None:
    old = _tiny_peft(seed=2)
    hidden = tmp_path / ".adapter-4116gmos"
    old.save_pretrained(str(hidden))
    (tmp_path / "adapter").symlink_to(hidden.name)
    model = _tiny_peft()
    save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").is_symlink() and [p.name for p in tmp_path.iterdir()] == ["adapter"]
    _assert_loads_as(tmp_path / "adapter", model)


def test_a_failed_rename_puts_the_previous_adapter_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    previous, model = _tiny_peft(seed=2), _tiny_peft()
    path = save_adapter(previous, tmp_path / "adapter")
    rename, calls = os.rename, []

    def second_rename_fails(source: Any, destination: Any) -> None:
        calls.append(Path(source).name)
        if len(calls) == 2:  # the new folder into place, after the previous one was moved aside
            raise OSError(5, "Input/output error")
        rename(source, destination)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="Input/output error"):
        save_adapter(model, path)
    monkeypatch.undo()
    assert calls[0] == "adapter" and [p.name for p in tmp_path.iterdir()] == ["adapter"]
    _assert_loads_as(path, previous)
