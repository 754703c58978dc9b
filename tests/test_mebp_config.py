"""MeBPConfig: one validated options object, the keyword convenience, the Hydra ``mebp`` group."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from _mebp_utils import add_lora, lora_grads, tiny_config, tiny_llama, tokens
from lcsb_lightning.mebp import MeBPConfig, QuantizedMeBP, apply_mebp, load_compressed, mebp_state

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_a_config_and_the_keywords_train_alike() -> None:
    base = add_lora(tiny_llama(num_layers=2))
    config = MeBPConfig(fmt="int4", group_size=32, keep_recomputed_weights=False)
    by_config = apply_mebp(copy.deepcopy(base), config)
    by_keywords = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, keep_recomputed_weights=False)
    for model in (by_config, by_keywords):
        model(tokens(), labels=tokens()).loss.backward()
    first, second = lora_grads(by_config), lora_grads(by_keywords)
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert mebp_state(by_config).config is config and mebp_state(by_keywords).config == config


def test_keywords_beside_a_config_override_its_fields() -> None:
    config = MeBPConfig(fmt="int4", group_size=32)
    plugin = QuantizedMeBP(config, weights="mmap", precision="bf16-mixed")
    assert plugin.config == dataclasses.replace(config, weights="mmap") and plugin.precision == "bf16-mixed"
    assert QuantizedMeBP(config).config is config
    model = load_compressed(tiny_config(num_layers=2), config, group_size=64)
    assert mebp_state(model).config == dataclasses.replace(config, group_size=64)


def test_the_plugin_shows_the_configs_defaults_and_its_fields_list_their_choices() -> None:
    """LightningCLI reads both: the plugin's ``config`` default (every field with its value) and each field's type."""
    import inspect
    import typing

    from lcsb_lightning.mebp._internal.formats import FORMATS
    from lcsb_lightning.mebp.config import OFFLOAD_MODES, WEIGHT_STORAGE

    parameters = inspect.signature(QuantizedMeBP).parameters
    assert list(parameters) == ["config", "precision", "options"]
    assert parameters["config"].default == MeBPConfig()
    hints = typing.get_type_hints(MeBPConfig)
    for name, allowed in (("fmt", FORMATS), ("offload", OFFLOAD_MODES), ("weights", WEIGHT_STORAGE)):
        assert typing.get_args(hints[name]) == allowed, (name, hints[name])
    assert QuantizedMeBP().config == MeBPConfig() and QuantizedMeBP(offload_dir=None).config.offload_dir is None


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: apply_mebp(tiny_llama(num_layers=2), fmt="int4", group=32),
         r"apply_mebp: unknown option\(s\) 'group'; the MeBPConfig fields are fmt, group_size, checkpoint"),
        (lambda: QuantizedMeBP("int4"), r"QuantizedMeBP: `config` must be a MeBPConfig or None, got str"),
        (lambda: MeBPConfig(fmt="int4", compress_embeddings="no"), r"`compress_embeddings` must be a bool, got 'no'"),
        (lambda: MeBPConfig(fmt="int4", offload_dir=3), r"`offload_dir` must be a directory path or None, got 3"),
    ],
)
def test_bad_options_name_the_option_and_the_allowed_values(call, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        call()


def test_validated_once_and_frozen() -> None:
    config = MeBPConfig(fmt="int4", ignore_modules=(name for name in ["lm_head"]))
    assert config.ignore_modules == ("lm_head",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.fmt = "nf4"  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"`weights='disk'` is not supported; choose one of 'auto', 'mmap', 'ram'"):
        dataclasses.replace(config, weights="disk")


@pytest.mark.parametrize("option", ["int4", "nf4"])
def test_every_mebp_yaml_is_a_valid_config(option: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import lcsb_lightning.recipes.config  # noqa: F401  (stores the schema conf/config.yaml names first)

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        node = compose("config", overrides=[f"mebp={option}", "mebp.group_size=32", "mebp.weights=mmap"]).mebp
        none = compose("config", overrides=["mebp=none"]).mebp
    config = MeBPConfig.from_node(OmegaConf.to_container(node))
    assert (config.fmt, config.group_size, config.weights) == (option, 32, "mmap")
    assert {f.name for f in dataclasses.fields(MeBPConfig)} == set(node) - {"_target_"}  # one shape, every field
    assert "_target_" not in none  # no plugin


def test_the_default_config_is_a_plain_checked_config_that_needs_no_bitsandbytes() -> None:
    """Issue 57: DEFAULT_CONFIG was built with object.__new__ (unchecked) and recognised by identity."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['bitsandbytes'] = None\n"
            "import dataclasses\n"
            "from lcsb_lightning.mebp.config import DEFAULT_CONFIG, MeBPConfig, build_config\n"
            "assert DEFAULT_CONFIG == MeBPConfig() and (DEFAULT_CONFIG.fmt, DEFAULT_CONFIG.group_size) == ('auto', 32)\n"
            "assert build_config(DEFAULT_CONFIG, {'fmt': 'int4'}) == MeBPConfig(fmt='int4')\n"
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
