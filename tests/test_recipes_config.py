"""Every option of every config group composes and instantiates (as lightning-hydra-template's config tests)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import instantiate
from lightning import Trainer

from _recipes_utils import FAST, compose_cfg, one_thread, write_cls, write_qa, write_text  # noqa: F401
from lcsb_lightning.recipes.cli import CONFIG_MODULE
from lcsb_lightning.recipes.models import ModelBundle

CONF = Path(importlib.import_module(CONFIG_MODULE).__file__).parent  # the packaged configs


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_its_options() -> None:
    assert options("model") == ["gemma3_1b", "hf", "qwen2.5_0.5b", "qwen2.5_1.5b", "qwen2.5_3b", "smollm2_135m",
                                "smollm2_135m_random", "smollm2_360m_random", "tiny"]
    assert options("task") == ["chat", "classification", "gsm8k", "lm_text", "pydoc", "qa_jsonl", "sst2", "wikitext2"]
    assert options("policy") == ["cyclic", "dyadic", "full", "grad_norm", "paper", "random", "top_only"]
    assert options("mebp") == ["auto", "int4", "nf4", "none"]
    assert options("trainer") == ["cpu", "ddp", "gpu"]
    assert options("logger") == ["csv", "tensorboard"]
    assert "paper" in options("experiment")


def test_every_yaml_opens_with_its_launch_command() -> None:
    paths = sorted(CONF.rglob("*.yaml"))
    assert len(paths) > 30
    for path in paths:
        first = path.read_text().splitlines()[0]
        if first.startswith("# @package"):
            first = path.read_text().splitlines()[1]
        assert first.startswith(("# lcsb-finetune", "# lcsb-benchmark")), path


def test_default_config_composes() -> None:
    cfg = compose_cfg([])
    assert cfg.model._target_.endswith("smollm2_135m")
    assert cfg.task.builtin == "pydoc" and cfg.policy._target_.endswith("DyadicPolicy") and cfg.policy.levels == 3
    assert cfg.lcsb.backward == "all_reached" and cfg.guard.action == "skip" and cfg.checkpoint_every == 50


POLICIES = {"cyclic": "CyclicPolicy", "dyadic": "DyadicPolicy", "full": "FullPolicy",
            "grad_norm": "GradNormPolicy", "paper": "CyclicPolicy", "random": "RandomPolicy",
            "top_only": "TopOnlyPolicy"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_options_instantiate(name: str) -> None:
    """Every policy option is the SelectionPolicy itself; LCSBCallback's options are the one ``lcsb`` node."""
    cfg = compose_cfg([f"policy={name}"])
    policy = instantiate(cfg.policy)
    assert type(policy).__name__ == POLICIES[name]
    callback = instantiate(cfg.lcsb, policy=policy)
    assert type(callback).__name__ == "LCSBCallback" and callback.policy is policy
    assert callback.backward == ("identity" if name == "paper" else "all_reached")


@pytest.mark.parametrize(("overrides", "key", "value"), [
    (["policy=cyclic", "policy.fraction=0.5"], "fraction", 0.5),
    (["policy=paper", "policy.fraction=0.5"], "fraction", 0.5),
    (["policy=random", "policy.fraction=0.5"], "fraction", 0.5),
    (["policy=grad_norm", "policy.layers_per_step=3", "policy.fraction=null"], "layers_per_step", 3),
    (["policy=dyadic", "policy.levels=4"], "levels", 4),
    (["policy=top_only", "policy.switch_every=2"], "switch_every", 2),
])
def test_policy_overrides_read_the_same_for_every_policy(overrides: list[str], key: str, value: object) -> None:
    assert getattr(instantiate(compose_cfg(overrides).policy), key) == value


def test_paper_is_cyclic_with_the_identity_path_and_lcsb_overrides_win() -> None:
    paper, cyclic = compose_cfg(["policy=paper"]), compose_cfg(["policy=cyclic"])
    assert paper.policy == cyclic.policy and paper.lcsb.backward == "identity"
    assert compose_cfg(["policy=paper", "lcsb.backward=all_reached"]).lcsb.backward == "all_reached"


@pytest.mark.parametrize("name", ["skip", "stop", "rollback"])
def test_guard_options_differ_by_their_action(name: str) -> None:
    guard = compose_cfg([f"guard={name}"]).guard
    assert {k: v for k, v in guard.items() if k != "action"} == {k: v for k, v in compose_cfg([]).guard.items() if k != "action"}
    assert instantiate(guard).action == name


def test_none_options_carry_no_node() -> None:
    """``guard=none`` composes no callback (no ``_target_``, no key that nothing reads)."""
    cfg = compose_cfg(["guard=none"])
    assert not cfg.guard


@pytest.mark.parametrize("name", ["none", "nf4", "int4"])
def test_mebp_options_instantiate(name: str) -> None:
    cfg = compose_cfg([f"mebp={name}"])
    if name == "none":
        assert "_target_" not in cfg.mebp
    else:
        assert type(instantiate(cfg.mebp)).__name__ == "QuantizedMeBP"


@pytest.mark.parametrize("name", ["r16", "r8"])
def test_lora_options_instantiate(name: str) -> None:
    from peft import get_peft_model

    from lcsb_lightning.recipes.models import random_init

    lora = instantiate(compose_cfg([f"lora={name}"]).lora, _convert_="all")
    assert lora.r == int(name[1:]) and lora.target_modules == "all-linear"
    model = get_peft_model(random_init(instantiate(compose_cfg(["model=tiny"]).model.config)).model, lora)
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # the LM head is left out


@pytest.mark.parametrize("name", ["csv", "tensorboard"])
def test_logger_options_instantiate(name: str, tmp_path: Path) -> None:
    logger = instantiate(compose_cfg([f"logger={name}"]).logger, save_dir=str(tmp_path))
    assert Path(logger.log_dir).parent == tmp_path


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_trainer_options_instantiate(name: str) -> None:
    cfg = compose_cfg([f"trainer={name}"])
    if name == "gpu" and not torch.cuda.is_available():
        pytest.skip("trainer=gpu needs a CUDA device (composition checked)")
    assert isinstance(instantiate(cfg.trainer, logger=False, enable_progress_bar=False), Trainer)


def test_experiment_paper_sets_paper_values() -> None:
    cfg = compose_cfg(["experiment=paper"])
    assert (cfg.batch_size, cfg.seq_len, cfg.module.lr, cfg.module.weight_decay, cfg.trainer.max_steps) == (
        1, 256, 1e-4, 0.01, 1000
    )


def test_task_options_instantiate(tmp_path: Path) -> None:
    txt, txt_eval = write_text(tmp_path)
    qa, qa_eval = write_qa(tmp_path)
    cls, cls_eval = write_cls(tmp_path)
    overrides = {
        "pydoc": [],
        "lm_text": [f"task.train_files=[{txt}]", f"task.eval_files=[{txt_eval}]"],
        "qa_jsonl": [f"task.train_file={qa}", f"task.eval_file={qa_eval}"],
        "classification": [
            f"task.train_file={cls}", f"task.eval_file={cls_eval}", "task.text_column=sentence",
            "task.verbalizer={0: bad, 1: good}",
        ],
    }
    for name, extra in overrides.items():
        task = instantiate(compose_cfg([f"task={name}", *extra]).task, _convert_="all")
        assert task.kind in ("lm", "qa", "classification")


@pytest.mark.parametrize("name", ["wikitext2", "gsm8k", "sst2"])
def test_preset_options_instantiate(name: str) -> None:
    task = instantiate(compose_cfg([f"task={name}"]).task, _convert_="all")  # the hub: nothing is read yet
    assert task.kind in ("lm", "qa", "classification") and task.source == "hub"


@pytest.mark.parametrize(
    ("name", "layers", "params_b"),
    [("qwen2.5_0.5b", 24, 0.494), ("qwen2.5_1.5b", 28, 1.54), ("qwen2.5_3b", 36, 3.09), ("gemma3_1b", 26, 1.0),
     ("smollm2_135m_random", 30, 0.1345), ("smollm2_360m_random", 32, 0.3618)],
)
def test_random_init_shapes_instantiate_on_meta(name: str, layers: int, params_b: float) -> None:
    bundle = instantiate(compose_cfg([f"model={name}", "model.init_device=meta"]).model)
    assert isinstance(bundle, ModelBundle)
    assert bundle.model.config.num_hidden_layers == layers
    n = sum(p.numel() for p in bundle.model.parameters()) / 1e9
    assert abs(n - params_b) / params_b < 0.05, n


def test_tiny_and_hf_models_instantiate(tmp_path: Path) -> None:
    tiny = instantiate(compose_cfg(["model=tiny"]).model)
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    hf = instantiate(compose_cfg(["model=hf", f"model.name_or_path={tmp_path / 'm'}"]).model)
    x = torch.tensor([[1, 5, 9]])
    assert torch.allclose(tiny.model(x).logits, hf.model(x).logits)


def test_smollm2_option_composes() -> None:
    assert compose_cfg(["model=smollm2_135m"]).model.dtype == "float32"  # instantiation: tests/test_recipes_models.py (slow)


@pytest.mark.parametrize("override", ["seq_len=abc", "batch_size=2.5", "trainer.max_steps=1.5", "module.lr=fast",
                                      "lcsb.probe_every=often"])
def test_a_value_of_the_wrong_type_fails_at_composition(override: str) -> None:
    """The schema (lcsb_lightning/recipes/config.py) types the recipe's own values: Hydra refuses them while composing."""
    with pytest.raises(ConfigCompositionException, match=f"Error merging override {override}") as err:
        compose_cfg([override])
    assert "could not be converted" in str(err.value.__cause__)


def test_unknown_option_lists_the_available_ones() -> None:
    with pytest.raises(MissingConfigException) as err:
        compose_cfg(["policy=nope"])
    assert "cyclic" in str(err.value) and "grad_norm" in str(err.value)


