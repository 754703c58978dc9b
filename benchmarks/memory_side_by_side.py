"""Peak RSS and step time of QuantizedMeBP configurations side by side, one fresh process per arm.

Arms alternate within each round so that drifting machine load hits all of them alike. An arm is
``LABEL=ARM`` (an arm of the memory study: ``mebp``, ``mebp_lean``, ``mebp_no_trim``, ``mebp_lcsb``,
``qlora``) optionally run from another checkout with ``LABEL=ARM@PATH`` (for example version 0.2.0
in a git worktree: ``git worktree add /tmp/v020 3f76c2f``)::

    python benchmarks/memory_side_by_side.py --rounds 2 --steps 4 \\
        "before (0.2.0)=mebp@/tmp/v020" "defaults=mebp" "release_heap=False=mebp_no_trim" "lean=mebp_lean"

It prints one line per measurement and a markdown table at the end, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lcsb_lightning.bench import memory  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"_target_": "transformers.Qwen2Config", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5_0.5b": {"_target_": "transformers.Qwen2Config", "vocab_size": 151936, "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "gemma3_1b": {"_target_": "transformers.Gemma3TextConfig", "vocab_size": 262144, "hidden_size": 1152,
                  "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                  "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "sliding_window": 512,
                  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}


def parse_arm(text: str) -> tuple[str, str, str]:
    """``"LABEL=ARM[@PATH]"`` -> ``(label, arm, checkout path)``."""
    label, sep, rest = text.rpartition("=")
    arm, _, path = rest.partition("@")
    if not sep or not label or arm not in memory.ARMS:
        raise argparse.ArgumentTypeError(f"expected LABEL=ARM[@PATH] with ARM in {', '.join(memory.ARMS)}, got {text!r}")
    checkout = Path(path or ROOT).resolve()
    if not (checkout / "lcsb_lightning").is_dir():
        raise argparse.ArgumentTypeError(f"{checkout} holds no lcsb_lightning package")
    return label, arm, str(checkout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="+", type=parse_arm, help="LABEL=ARM[@PATH]")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5_0.5b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("outputs/memory_side_by_side"))
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    start_dir = os.getcwd()
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for index, (label, arm, checkout) in enumerate(args.arms):
            # The child imports this checkout: first on its path, and its working directory (``python -m``
            # puts the working directory before PYTHONPATH).
            os.environ["PYTHONPATH"] = checkout
            os.chdir(checkout)
            spec = {"arm": arm, "model_config": SHAPES[args.shape], "folder": None, "fmt": "nf4", "group_size": 64,
                    "fraction": 0.25, "backward": "all_reached", "seq_len": 256, "rank": 8, "warmup": args.warmup,
                    "steps": args.steps, "malloc": "default"}
            load = os.getloadavg()[0]
            figures = memory.measure(spec, args.out / f"round{round_index}_arm{index}.json")
            rows.append({"round": round_index, "label": label, "load": load, **figures})
            print(f"round {round_index} | {label} | peak {figures['peak_rss_mb']:.0f} MiB | model+training "
                  f"{figures['model_and_training_mb']:.0f} MiB | after load {figures['rss_after_load_mb']:.0f} MiB | "
                  f"{figures['step_s']:.2f} s/step | load average {load:.2f}", flush=True)
    os.chdir(start_dir)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.shape}, nf4/64, LoRA r8, seq 256, {args.warmup} warm-up + {args.steps} steps, one process per arm\n")
    print("| arm | peak RSS (MiB) per round | model and training (MiB) | RSS after loading (MiB) | s/step per round |")
    print("|---|---|---|---|---|")
    for label, _, _ in args.arms:
        mine = [r for r in rows if r["label"] == label]
        cells = [" / ".join(f"{r[key]:{fmt}}" for r in mine) for key, fmt in
                 (("peak_rss_mb", ".0f"), ("model_and_training_mb", ".0f"), ("rss_after_load_mb", ".0f"), ("step_s", ".2f"))]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
