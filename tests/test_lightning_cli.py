"""LightningCLI: recipes/lightning_cli.py with LCSBCallback and QuantizedMeBP from flags and from its YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from lcsb_lightning import LCSBCallback
from lcsb_lightning.mebp import CompressedLinear, MeBPConfig, QuantizedMeBP

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
FIELDS = [field.name for field in dataclasses.fields(MeBPConfig)]
#: A 2-step run of the tiny model, quiet, under the test's folder.
SHORT = ["--model.tiny=true", "--trainer.max_steps=2", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
         "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
PLUGIN_FLAGS = ["--trainer.plugins=lcsb_lightning.QuantizedMeBP", "--trainer.plugins.config.fmt=int4"]


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(RECIPES))
    monkeypatch.setattr("sys.argv", ["lightning_cli.py"])  # only main's args
    monkeypatch.setattr("sys.dont_write_bytecode", True)  # no recipes/__pycache__ beside the recipe files
    import lightning_cli

    return lightning_cli


def _check_both_ran(cli) -> None:
    trainer = cli.trainer
    plugin = trainer.precision_plugin
    assert isinstance(plugin, QuantizedMeBP) and plugin.config.fmt == "int4", plugin
    assert any(isinstance(m, CompressedLinear) for m in cli.model.modules()), "no Linear was compressed"
    assert plugin.last_metrics.get("mebp/decompress_fwd_ms", 0.0) > 0.0, plugin.last_metrics
    assert [type(c) for c in trainer.callbacks].count(LCSBCallback) == 1
    assert trainer.global_step == 2 and "lcsb/num_selected" in trainer.callback_metrics, trainer.callback_metrics


def test_flags_add_the_callback_and_the_plugin(recipe: ModuleType, tmp_path: Path) -> None:
    cli = recipe.main(["fit", *SHORT, "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                       f"--trainer.default_root_dir={tmp_path}",
                       "--trainer.callbacks+=lcsb_lightning.LCSBCallback", "--trainer.callbacks.policy=dyadic",
                       *PLUGIN_FLAGS, "--trainer.plugins.config.group_size=32"])
    _check_both_ran(cli)
    assert cli.trainer.precision_plugin.config == MeBPConfig(fmt="int4", group_size=32)


def test_the_yaml_adds_the_callback_and_the_plugin(recipe: ModuleType, tmp_path: Path) -> None:
    cli = recipe.main(["fit", "--config", str(RECIPES / "lightning_cli.yaml"), *SHORT])
    _check_both_ran(cli)
    assert cli.trainer.precision_plugin.config == MeBPConfig(fmt="int4", group_size=64)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb_logs" / "lightning_cli").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file under tb_logs/lightning_cli"
    tags = set(EventAccumulator(str(events[0].parent)).Reload().Tags()["scalars"])
    assert {"train/loss", "val/loss", "lcsb/num_selected", "mebp/decompress_fwd_ms"} <= tags, tags


def _printed_config(recipe: ModuleType, capsys: pytest.CaptureFixture, *flags: str) -> dict:
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["fit", *flags, "--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def _plugin_config(recipe: ModuleType, monkeypatch: pytest.MonkeyPatch, *flags: str) -> MeBPConfig:
    """The plugin's MeBPConfig of a run (its fit not run)."""
    monkeypatch.setattr("lightning.pytorch.cli.LightningCLI._run_subcommand", lambda self, subcommand: None)
    return recipe.main(["fit", *flags]).trainer.precision_plugin.config


@pytest.mark.parametrize("options", [{}, {"fmt": "int4", "weights": "mmap"}])
def test_print_config_shows_every_plugin_setting_with_its_value(recipe: ModuleType, capsys: pytest.CaptureFixture,
                                                                options: dict) -> None:
    flags = [f"--trainer.plugins.config.{name}={value}" for name, value in options.items()]
    printed = _printed_config(recipe, capsys, "--model.tiny=true", "--trainer.plugins=lcsb_lightning.QuantizedMeBP", *flags)
    plugins = printed["trainer"]["plugins"]
    plugin = plugins[0] if isinstance(plugins, list) else plugins
    assert plugin["class_path"] == "lcsb_lightning.QuantizedMeBP"
    expected = {**dataclasses.asdict(MeBPConfig(**options)), "ignore_modules": []}
    assert plugin["init_args"] == {"config": expected, "precision": "32-true"}, plugin["init_args"]


def test_a_saved_config_replays_the_same_plugin(recipe: ModuleType, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flags = ["--model.tiny=true", *PLUGIN_FLAGS, "--trainer.plugins.config.group_size=32",
             f"--trainer.plugins.config.offload_dir={tmp_path}", "--trainer.plugins.config.ignore_modules=[lm_head]"]
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(_printed_config(recipe, capsys, *flags)))
    ran = _plugin_config(recipe, monkeypatch, *flags)
    assert ran == MeBPConfig(fmt="int4", group_size=32, offload_dir=str(tmp_path), ignore_modules=("lm_head",))
    assert _plugin_config(recipe, monkeypatch, "--config", str(saved)) == ran
    # null sets a field back to its default over a saved value (as JSON: jsonargparse 4.53 turns the dotted
    # flag's null into the string 'None' for a dataclass inside a plugin's init_args)
    reset = _plugin_config(recipe, monkeypatch, "--config", str(saved), '--trainer.plugins.config={"offload_dir": null}')
    assert reset == dataclasses.replace(ran, offload_dir=None)


def test_a_bad_value_is_refused_before_the_model_is_built(recipe: ModuleType, capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recipe, "load", lambda tiny: pytest.fail("the model was built before the refusal"))
    with pytest.raises(SystemExit) as exit_:
        recipe.main(["fit", "--model.tiny=true", "--trainer.plugins=lcsb_lightning.QuantizedMeBP",
                     "--trainer.plugins.config.fmt=int3"])
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert "int3" in message and "fmt" in message and "'int4', 'int4_asym', 'nf4', 'fp4'" in message, message
