"""Peak anonymous memory and step time of QuantizedMeBP configurations side by side, one fresh process each.

Arms alternate within each round so that drifting machine load hits all of them alike. An arm is
``LABEL=OPTIONS`` (MeBPConfig fields as JSON over fmt=int4, group_size=64) optionally run from another
checkout, ``LABEL=OPTIONS@PATH`` (for example 0.7.0 in a git worktree: ``git worktree add /tmp/v070 53d03cc``;
this file's measuring module is run there)::

    python benchmarks/memory_side_by_side.py --rounds 2 "0.7.0 defaults={}@/tmp/v070" "defaults={}" 'lean={"offload": "mmap"}'

Every arm trains with ``--optimizer`` (``adamw``, the default, or ``sgd``: MeSP's, without momentum).
It prints one line per measurement and a markdown table of the medians at the end, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from lcsb_lightning.bench import memory  # noqa: E402


def parse_arm(text: str) -> tuple[str, dict[str, Any], str]:
    """``"LABEL=OPTIONS[@PATH]"`` -> ``(label, options, checkout path)``."""
    label, sep, rest = text.partition("=")
    options, _, path = rest.partition("@")
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"OPTIONS must be a JSON object, got {options!r} ({exc})") from exc
    checkout = Path(path or ROOT).resolve()
    if not sep or not label or not isinstance(parsed, dict) or not (checkout / "lcsb_lightning").is_dir():
        raise argparse.ArgumentTypeError(f"expected LABEL=OPTIONS[@PATH] with a JSON object and a checkout, got {text!r}")
    return label, parsed, str(checkout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="+", type=parse_arm, help="LABEL=OPTIONS[@PATH]")
    parser.add_argument("--shape", default="qwen2.5_0.5b", help="a conf/model/*.yaml random-init shape")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=memory.OPTIMIZERS, default="adamw",
                        help="every arm's optimizer (sgd: without momentum, as MeSP trains)")
    args = parser.parse_args(argv)
    model_config = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{args.shape}.yaml").config, resolve=True)
    print(f"optimizer: {args.optimizer}; load average before: {os.getloadavg()}", flush=True)
    figures: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for label, options, checkout in args.arms:
                if checkout != str(ROOT):  # measure the other checkout's library with this measuring module
                    shutil.copy(memory.__file__, Path(checkout) / "lcsb_lightning" / "bench" / "memory.py")
                spec = {"arm": "mebp", "model_config": model_config, "options": {"group_size": 64, **options},
                        "seq_len": args.seq_len, "rank": 8, "warmup": args.warmup, "steps": args.steps,
                        "optimizer": args.optimizer}
                os.environ["PYTHONPATH"] = checkout
                os.chdir(checkout)  # `python -m` puts the working directory first on sys.path
                result = memory.measure(spec, Path(tmp) / f"{round_index}_{len(figures[label])}_{abs(hash(label))}.json")
                figures[label].append(result)
                print(f"round {round_index} {label}: train {result['peak_anon_train_mb']} MB anon, load "
                      f"{result['peak_anon_load_mb']} MB, whole RSS {result['peak_rss_mb']} MB, {result['step_s']} s/step, "
                      f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\nload average after: {os.getloadavg()}\n")
    keys = ("peak_anon_train_mb", "peak_anon_load_mb", "peak_rss_above_import_mb", "peak_rss_mb", "step_s")
    print("| arm | " + " | ".join(keys) + " | s/step vs first |\n|" + "---|" * (len(keys) + 2))
    first = statistics.median(r["step_s"] for r in next(iter(figures.values())))
    for label, results in figures.items():
        medians = [statistics.median(r[k] for r in results) for k in keys]
        print(f"| {label} | " + " | ".join(f"{m:g}" for m in medians) + f" | {medians[-1] / first:.3f}x |")
    for label, results in figures.items():
        print(f"\n{label} breakdown (last round): {json.dumps(results[-1]['breakdown'])}")


if __name__ == "__main__":
    main()
