"""What a user installs: the core import stays light, the configs travel with the package, the recipes run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Optional dependencies that ``import lcsb_lightning`` must not pull in (Lightning itself may import others).
HEAVY = ("hydra", "omegaconf", "tensorboard", "matplotlib", "gguf", "datasets", "bitsandbytes", "peft", "safetensors")


def test_core_import_loads_no_optional_dependency() -> None:
    code = (
        "import sys, json\n"
        "import lightning.pytorch\n"
        "before = set(sys.modules)\n"
        "from lcsb_lightning import LCSBCallback, LCSBController, QuantizedMeBP, apply_mebp\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before} & set(heavy))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_packaged_configs_are_the_repository_configs() -> None:
    import lcsb_lightning.conf as conf

    assert Path(conf.__file__).resolve().parent == (ROOT / "conf").resolve()  # editable install: the same files


def test_every_config_group_is_a_listed_package() -> None:
    """A config group missing from pyproject's packages would be left out of the wheel (and setuptools warns
    at every install about a folder it can import but does not package)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    groups = {f"lcsb_lightning.conf.{d.name}" for d in (ROOT / "conf").iterdir()
              if d.is_dir() and any(d.glob("*.yaml"))}
    assert groups and groups <= listed, sorted(groups - listed)


def test_hand_written_loop_runs() -> None:
    """(recipes/lightning_module.py runs in tests/test_readme.py.)"""
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "hand_written_loop.py"), "--steps", "4"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]


def test_phone_budget_recipe_composes_from_the_recipes_folder(tmp_path: Path) -> None:
    import shutil

    script = shutil.which("lcsb-finetune") or str(Path(sys.executable).parent / "lcsb-finetune")
    done = subprocess.run([script, "--config-dir", str(ROOT / "recipes"), "--config-name", "phone_budget", "--cfg", "job"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fmt: auto" in done.stdout and "DyadicPolicy" in done.stdout and "chunked_loss: true" in done.stdout


def test_every_recipe_file_opens_with_its_launch_command() -> None:
    for path in sorted((ROOT / "recipes").iterdir()):
        first = path.read_text().splitlines()[0]
        assert first.startswith(("# python recipes/", "# lcsb-finetune")), path


def test_lcsb_finetune_output_is_quiet_and_ends_with_its_table(tmp_path: Path) -> None:
    import shutil

    script = shutil.which("lcsb-finetune") or str(Path(sys.executable).parent / "lcsb-finetune")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [script, "model=tiny", "task=pydoc", "trainer.max_steps=2", "trainer.val_check_interval=2", "seq_len=32",
         "task.max_eval_examples=2", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "💡 Tip" not in output and "flops_per_batch" not in output
    # deprecation notices between the libraries (peft -> transformers, Lightning -> torch): nothing a user can act on
    assert "is_gradient_checkpointing" not in output and "LeafSpec" not in output, output
    assert "set_vital" not in output, output  # torchdata's loader calls a deprecated torch function
    assert "weights_only` was not set" not in output, output  # a resumable checkpoint says what it holds
    lcsb_lines = [line for line in output.splitlines() if "LCSB: " in line and "over 4 blocks" in line]
    assert len(lcsb_lines) == 1, lcsb_lines  # one line per message, not Lightning's and Hydra's both
    for row in ("val/loss", "peak memory", "adapter", "loss curve"):
        assert row in output
    assert (run_dir / "loss_curve.png").stat().st_size > 1000 and (run_dir / "finetune.log").is_file()


def test_version_is_the_installed_distribution_version() -> None:
    import importlib.metadata

    import lcsb_lightning

    assert lcsb_lightning.__version__ == importlib.metadata.version("lcsb-lightning")


def test_progress_bar_of_a_step_bounded_run_shows_no_negative_epoch_count() -> None:
    from types import SimpleNamespace

    from lcsb_lightning.recipes.progress import LCSBProgressBar

    bar = LCSBProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # what Lightning sets when only max_steps bounds the run
    assert bar._get_train_description(0).strip() == "Training"
    bar._trainer = SimpleNamespace(max_epochs=3)
    assert bar._get_train_description(1).strip() == "Epoch 1/2"


@pytest.mark.parametrize(("command", "extra"), [("finetune_main", "recipes"), ("benchmark_main", "bench")])
def test_console_scripts_without_their_extra_name_it_in_one_line(command: str, extra: str) -> None:
    """A wheel installed without extras: the console script says which extra to install, no traceback."""
    code = (
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('hydra', 'torchdata'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        f"from lcsb_lightning.recipes.cli import {command}\n"
        f"{command}()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    message = done.stderr.strip().splitlines()
    assert len(message) == 1 and f"lcsb-lightning[{extra}]" in message[0] and "hydra" in message[0], message
