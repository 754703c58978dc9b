"""Short fine-tuning runs of every task type with the tiny model, adapter reload, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from peft import PeftModel

from _recipes_utils import FAST, compose_cfg, one_thread, run_finetune_cli, write_cls, write_qa, write_text  # noqa: F401
from lcsb_lightning.recipes.metrics import LanguageModelMetrics
from lcsb_lightning.recipes.batching import PaddingCollator
from lcsb_lightning.recipes.train import run_finetune


def _run(overrides: list[str], out: Path) -> dict:
    summary = run_finetune(compose_cfg([*FAST, *overrides]), out)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["final_metrics"] == summary["final_metrics"]
    return summary


def _tensorboard_tags(out: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in (out / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"]) | set(acc.Tags()["images"])
    return tags


def _assert_outputs(out: Path, summary: dict) -> None:
    assert (out / "adapter" / "adapter_config.json").is_file()
    tags = _tensorboard_tags(out)
    assert {"train/loss", "train/lr", "val/loss", "val/ppl", "val/token_acc", "lcsb/num_selected"} <= tags, tags
    assert "lcsb/selection" in tags  # the block-selection image (every lcsb.log_every_n_steps=2 steps)
    assert summary["steps"] == 4 and summary["steps_per_second"] > 0 and summary["peak_rss_mb"] > 0
    counts = summary["block_selection_counts"]
    assert len(counts) == 4 and counts[-1] == 4  # the all_reached backward trains the top block at every step
    for key in ("val/loss", "val/ppl", "val/token_acc"):
        assert key in summary["initial_metrics"] and key in summary["final_metrics"]


def _assert_memory_by_phase(memory: dict) -> None:
    """summary.json's memory: every phase of the run in its order, each peak within the run's; training (the
    optimizer's moments, gradients, activations on top of the loaded model) peaks above loading."""
    phases = memory["phases"]
    assert list(phases) == ["load", "initial_eval", "train", "final_eval", "save", "plots"]
    assert memory["after_imports_anon_mib"] > 0 and memory["peak_anon_above_imports_mib"] > 0
    for name, peaks in phases.items():
        assert 0 < peaks["peak_anon_above_imports_mib"] <= memory["peak_anon_above_imports_mib"], (name, memory)
        assert memory["after_imports_rss_mib"] < peaks["peak_rss_mib"] <= memory["peak_rss_mib"], (name, memory)
    assert phases["train"]["peak_anon_above_imports_mib"] > phases["load"]["peak_anon_above_imports_mib"], memory


def test_summary_gives_the_memory_of_each_phase(tmp_path: Path) -> None:
    """In a fresh process, as a user runs it: inside the test process the heap that earlier tests freed absorbs
    a tiny run's growth, and its peaks above the imports read about 0."""
    train, evals = write_text(tmp_path)
    done = run_finetune_cli(tmp_path / "run", *FAST, "task=lm_text", f"task.train_files=[{train}]",
                            f"task.eval_files=[{evals}]")
    assert done.returncode == 0, done.stderr[-4000:]
    _assert_memory_by_phase(json.loads((tmp_path / "run" / "summary.json").read_text())["memory"])


def test_lm_text_run_and_adapter_reload(tmp_path: Path) -> None:
    train, evals = write_text(tmp_path)
    overrides = ["task=lm_text", f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "module.lr=1e-2"]
    out = tmp_path / "run"
    summary = _run(overrides, out)
    _assert_outputs(out, summary)
    assert summary["final_metrics"]["val/loss"] < summary["initial_metrics"]["val/loss"]

    # Reload the adapter on a fresh base model: the final eval loss is reproduced.
    assert _reloaded_eval_loss(overrides, out / "adapter") == pytest.approx(summary["final_metrics"]["val/loss"], abs=1e-4)


def _reloaded_eval_loss(overrides: list[str], adapter: Path) -> float:
    """The eval loss of ``adapter`` loaded on a fresh base model, computed outside the recipe."""
    cfg = compose_cfg([*FAST, *overrides])
    bundle = instantiate(cfg.model)
    model = PeftModel.from_pretrained(bundle.model, str(adapter)).eval()
    data = instantiate(cfg.task, _convert_="all").build(bundle.tokenizer, cfg.seq_len)
    metric, pad = LanguageModelMetrics(), PaddingCollator(bundle.tokenizer)
    with torch.no_grad():
        for i in range(0, len(data.eval), cfg.eval_batch_size):
            batch = pad(data.eval[i : i + cfg.eval_batch_size])
            metric.update(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"])
    return float(metric.compute()["loss"])


def _scalar_values(out: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: list[float] = []
    for path in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars(tag)]
    return values


@pytest.mark.parametrize("mode", ["min", "max"])
def test_adapter_best_is_the_adapter_of_the_best_evaluation(tmp_path: Path, mode: str) -> None:
    """``adapter_best`` holds the adapter of the evaluation with the best ``val/loss``: the lowest, or with
    ``best_adapter_mode=max`` the highest, which is the evaluation before training (not the last adapter)."""
    train, evals = write_text(tmp_path)
    overrides = ["task=lm_text", f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "module.lr=1e-2",
                 f"best_adapter_mode={mode}"]
    out = tmp_path / "run"
    summary = _run(overrides, out)
    evaluations = _scalar_values(out, "val/loss")  # before training, at steps 2 and 4, after training
    assert len(evaluations) == 4
    best = summary["best"]
    chosen = min(evaluations) if mode == "min" else max(evaluations)
    assert best["monitor"] == "val/loss" and best["value"] == pytest.approx(chosen, abs=1e-6)
    if mode == "max":
        assert best["step"] == 0 and best["value"] == pytest.approx(summary["initial_metrics"]["val/loss"], abs=1e-6)
    assert _reloaded_eval_loss(overrides, out / "adapter_best") == pytest.approx(best["value"], abs=1e-4)


@pytest.mark.parametrize(("patience", "steps", "stopped_early_at"), [(None, 8, None), (1, 4, 4), (2, 6, 6)])
def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(
    tmp_path: Path, patience: int | None, steps: int, stopped_early_at: int | None
) -> None:
    """With ``best_adapter_mode=max`` every evaluation after the first in-fit one (step 2) is worse, as the
    loss falls: patience 1 stops at step 4, patience 2 at step 6, none runs the 8 steps."""
    train, evals = write_text(tmp_path)
    out = tmp_path / "run"
    summary = _run(["task=lm_text", f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "module.lr=1e-2",
                    "trainer.max_steps=8", "best_adapter_mode=max", f"early_stopping_patience={patience or 'null'}"], out)
    assert summary["steps"] == steps and summary["stopped_early_at"] == stopped_early_at
    # real folders, and nothing hidden beside them (the folders of 0.9 were links to hidden ones)
    assert all((out / name).is_dir() and not (out / name).is_symlink() for name in ("adapter", "adapter_best"))
    assert not [p.name for p in out.iterdir() if p.name.startswith(".adapter")]


def test_best_adapter_null_writes_no_best_adapter(tmp_path: Path) -> None:
    train, evals = write_text(tmp_path)
    out = tmp_path / "run"
    summary = _run(["task=lm_text", f"task.train_files=[{train}]", f"task.eval_files=[{evals}]", "best_adapter=null"], out)
    assert summary["best"] is None and not (out / "adapter_best").exists() and (out / "adapter").is_dir()


def test_qa_jsonl_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lcsb_lightning.recipes.module import CausalLMModule

    def generate_text(self: CausalLMModule, prompt_ids: list[int]) -> str:
        # A stand-in for greedy generation: right on the first evaluation question (4 + 2), wrong on the rest.
        return "4 + 2 = 6\n#### 6" if "What is 4 plus 2?" in self.tokenizer.decode(prompt_ids) else "#### 99"

    monkeypatch.setattr(CausalLMModule, "generate_text", generate_text)
    train, evals = write_qa(tmp_path)
    out = tmp_path / "run"
    summary = _run(
        ["task=qa_jsonl", f"task.train_file={train}", f"task.eval_file={evals}", "task.num_generate=2",
         "task.max_new_tokens=6", "seq_len=64", "policy=random"],
        out,
    )
    _assert_outputs(out, summary)
    assert summary["initial_metrics"]["val/exact_match"] == 0.5  # 1 of the 2 generated answers matches
    assert summary["final_metrics"]["val/exact_match"] == 0.5


def test_classification_run(tmp_path: Path) -> None:
    train, evals = write_cls(tmp_path)
    out = tmp_path / "run"
    summary = _run(
        ["task=classification", f"task.train_file={train}", f"task.eval_file={evals}", "task.text_column=sentence",
         "task.verbalizer={0: bad, 1: good}", "policy=grad_norm", "logger=csv"],
        out,
    )
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "csv" / "metrics.csv").is_file()
    assert summary["final_metrics"]["val/accuracy"] == _verbalizer_accuracy(out, evals)


def _verbalizer_accuracy(out: Path, evals: Path) -> float:
    """The adapter's accuracy computed independently: the more likely of " bad" / " good" after each prompt."""
    cfg = compose_cfg(FAST)
    bundle = instantiate(cfg.model)
    model = PeftModel.from_pretrained(bundle.model, str(out / "adapter")).eval()
    tok = bundle.tokenizer
    rows = [line.split("\t") for line in evals.read_text().splitlines()[1:]]
    hits = 0
    for text, label in rows:
        prompt = tok(f"{text}\nLabel:", add_special_tokens=False).input_ids
        scores = []
        for word in (" bad", " good"):
            ids = prompt + tok(word, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            scores.append(sum(float(logp[i - 1, ids[i]]) for i in range(len(prompt), len(ids))))
        hits += int(scores.index(max(scores)) == int(label))
    return hits / len(rows)


def test_int4_mebp_without_an_evaluation_before_fit_keeps_its_adapter(tmp_path: Path) -> None:
    # The plugin converts the model inside fit, after LCSB's callback set-up: the final validation ran on
    # a half-removed wrapper before, and the run lost its adapter and summary.
    out = tmp_path / "run"
    overrides = ["task=pydoc", "task.max_eval_examples=4", "mebp=int4"]
    summary = _run([*overrides, "eval_before_training=false"], out)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert summary["initial_metrics"] == {}
    # The same run with an evaluation before fit (the path that always worked) trains the same (seeded, and
    # evaluation draws no random numbers): its final metrics are the ones this run must report, and they
    # are lower than its initial ones.
    reference = _run([*overrides, "eval_before_training=true"], tmp_path / "reference")
    assert summary["final_metrics"] == reference["final_metrics"]
    assert reference["final_metrics"]["val/loss"] < reference["initial_metrics"]["val/loss"]


def test_pydoc_run_with_int4_mebp(tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary = _run(["task=pydoc", "task.max_eval_examples=4", "mebp=int4", "module.chunked_loss=true", "policy=full"], out)
    assert summary["final_metrics"]["val/loss"] < summary["initial_metrics"]["val/loss"]  # it trained
    assert summary["block_selection_counts"] == [4, 4, 4, 4]
    assert {"mebp/decompress_fwd_ms", "mebp/decompress_bwd_ms"} <= _tensorboard_tags(out)


# ------------------------------------------------------------------------------------ bad input
def _assert_nothing_written(out: Path) -> None:
    assert not (out / "summary.json").exists() and not (out / "adapter").exists()


def test_missing_data_file_names_path_and_how_to_get_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match=r"nowhere/gsm8k/train.jsonl.*data_dir="):
        run_finetune(compose_cfg([*FAST, "task=gsm8k", f"data_dir={tmp_path}/nowhere"]), out)
    _assert_nothing_written(out)


def test_column_and_label_errors_show_what_was_seen(tmp_path: Path) -> None:
    train, evals = write_cls(tmp_path)
    base = ["task=classification", f"task.train_file={train}", f"task.eval_file={evals}"]
    out = tmp_path / "run"
    with pytest.raises(KeyError, match=r"text_column='text'.*columns seen: \['sentence', 'label'\]"):
        run_finetune(compose_cfg([*FAST, *base, "task.verbalizer={0: bad, 1: good}"]), out)
    with pytest.raises(KeyError, match=r"label\(s\) \['1'\].*labels seen: \['0', '1'\]"):
        run_finetune(compose_cfg([*FAST, *base, "task.text_column=0", "task.verbalizer={0: bad}"]), out)
    qa, qa_eval = write_qa(tmp_path)
    with pytest.raises(KeyError, match=r"\['problem'\].*fields seen: \['question', 'answer'\]"):
        run_finetune(
            compose_cfg([*FAST, "task=qa_jsonl", f"task.train_file={qa}", f"task.eval_file={qa_eval}", "task.prompt_field=problem"]),
            out,
        )
    _assert_nothing_written(out)


def test_seq_len_above_context_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"seq_len=1024 is above the model's context of 512: allowed: 2..512"):
        run_finetune(compose_cfg([*FAST, "task=pydoc", "seq_len=1024"]), out)
    _assert_nothing_written(out)


def test_progressive_freezing_in_the_recipe_replays_padded_classification_examples(tmp_path: Path) -> None:
    """``freeze=progressive``: from epoch 1 the lowest block is frozen, and with 4 training sentences (2 steps
    per epoch) every batch of epoch 2 replays its stored outputs, whatever padding its neighbour brings."""
    train, evals = write_cls(tmp_path)
    out = tmp_path / "run"
    summary = _run(
        ["task=classification", f"task.train_file={train}", f"task.eval_file={evals}", "task.text_column=sentence",
         "task.verbalizer={0: bad, 1: good}", "task.max_train_examples=4", "trainer.max_steps=6",
         "freeze=progressive", "freeze.schedule=[[1,1]]"],
        out,
    )
    assert summary["steps"] == 6
    assert _scalar_values(out, "freeze/frozen_blocks") == [1.0, 1.0]  # epochs 1 and 2
    # epoch 1 stores; epoch 2 replays every batch (the loss reads no padded position: a row replays at any width)
    assert _scalar_values(out, "freeze/cache_hit") == [0.0, 1.0]
