"""The GPU check's report: speed-ups, the JSON document and the markdown table, and where each figure comes from."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

WHAT = {"qlora": "peft + bnb nf4 + HF grad ckpt", "mebp": "load_compressed nf4/64, full backprop, chunked loss",
        "mebp_lcsb": "mebp + LCSB cyclic k=N/4"}
SOURCES = {
    "peak_mib": "resident_mib + the arm's largest step transient in the round robin (reset_peak_memory_stats before "
                "each measured step, then max_memory_allocated minus memory_allocated at its start)",
    "resident_mib": "memory_allocated after the arm's build and warm-up minus before its build (weights, LoRA, AdamW)",
    "warmup_peak_mib": "the largest max_memory_allocated of the arm's warm-up steps (reset at each step's start, no "
                       "other arm stepping) minus memory_allocated before its build; load_peak_mib: the same for its build",
    "step_s_mean": "mean wall time of the measured round-robin steps, torch.cuda.synchronize before and after",
    "mebp": "one instrumented step per MeBP arm after the timed ones (its timers synchronize around every "
            "decompression, so it is not timed)",
}


def environment(device: torch.device) -> dict[str, Any]:
    """GPU name, library versions and the date of this run."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"none ({device.type})",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: installed(name) for name in ("transformers", "peft", "bitsandbytes", "lightning")},
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def speedups(step_s: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """``{arm: {"vs_qlora": t_qlora / t_arm, "vs_mebp": t_mebp / t_arm}}`` (``None`` without the reference).

    Example::

        >>> speedups({"mebp": 2.0, "mebp_lcsb": 1.0})["mebp_lcsb"]
        {'vs_qlora': None, 'vs_mebp': 2.0}
    """
    return {arm: {f"vs_{ref}": (step_s[ref] / s if ref in step_s and s > 0 else None) for ref in ("qlora", "mebp")}
            for arm, s in step_s.items()}


def build_result(meta: dict[str, Any], figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: ``meta``, per-arm figures with their speed-ups, and where the figures come from."""
    ratios = speedups({arm: fig["step_s_mean"] for arm, fig in figures.items()})
    arms = {arm: {**fig, "speedup_vs_qlora": ratios[arm]["vs_qlora"], "speedup_vs_mebp": ratios[arm]["vs_mebp"]}
            for arm, fig in figures.items()}
    return {"meta": meta, "arms": arms, "sources": SOURCES}


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def to_mib(n: int) -> float:
    return round(n / 2**20, 1)


def format_table(result: dict[str, Any]) -> str:
    """The markdown report: GPU, versions and date, the table side by side, where the figures come from."""
    m = result["meta"]
    title = (f"## GPU check: {m['shape']}, {m['dtype']}, seq {m['seq_len']}, batch {m['batch']}, LoRA {m['lora']}, "
             f"{m['optimizer']}, {m['warmup']} warm-up + {m['steps']} measured steps per arm")
    lines = [title, "",
             f"GPU: {m['gpu']} | torch {m['torch']} | CUDA {m['cuda']} | {m['date']}", "",
             "| arm | what | peak MiB | s/step | speed-up vs qlora | speed-up vs mebp | blocks back-propagated/step |",
             "|---|---|---|---|---|---|---|"]
    for arm, f in result["arms"].items():
        depth = f"{f['backward_blocks_mean']:.2f} of {f['num_blocks']}" if "num_blocks" in f else "all"
        lines.append(f"| {arm} | {WHAT.get(arm, arm)} | {_num(f['peak_mib'], '.1f')} | {_num(f['step_s_mean'], '.4f')} "
                     f"| {_num(f['speedup_vs_qlora'], '.2f', 'x')} | {_num(f['speedup_vs_mebp'], '.2f', 'x')} | {depth} |")
    lines += ["", "Where the figures come from:", *(f"* {key}: {text}" for key, text in result["sources"].items())]
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` to ``path`` (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
