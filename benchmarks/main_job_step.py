"""The main job's step time under memory settings, side by side, and the streamed loss's vocabulary block.

Arms alternate round by round in one process through ``recipe_speed``'s loop (the recipe's own Trainer,
callbacks and data; one warm-up step, then ``--steps`` timed steps per round, the median over rounds).
An arm is ``LABEL=OVERRIDE[,OVERRIDE...]`` over ``lcsb-finetune model.source=gguf``::

    python benchmarks/main_job_step.py --rounds 3 "0.9.0=module.chunked_loss=false,keep_activations=null" \\
        "chunked=module.chunked_loss=true,keep_activations=null" "0.9.1=module.chunked_loss=true,keep_activations=8"
    python benchmarks/main_job_step.py --vocab-blocks 4194304 1048576   # the streamed loss alone

Prints the load average before and after and each arm's s/step against the first arm's. Run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``"LABEL=OVERRIDE[,OVERRIDE...]"`` -> ``(label, overrides)``."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise argparse.ArgumentTypeError(f"expected LABEL=OVERRIDE[,OVERRIDE...], got {text!r}")
    return label, rest.split(",")


def time_arms(arms: dict[str, list[str]], rounds: int, steps: int, task: str) -> dict[str, float]:
    """Each arm's s/step (``recipe_speed.time_task``'s median over rounds of the mean over a round's steps)."""
    from hydra import compose, initialize_config_module

    from lcsb_lightning.bench.recipe_speed import time_task
    from lcsb_lightning.recipes.cli import CONFIG_MODULE

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"), tempfile.TemporaryDirectory() as tmp:
        result = time_task(task, arms, ["model.source=gguf"], lambda o: compose(config_name="config", overrides=list(o)),
                           rounds=rounds, steps_per_round=steps, out_dir=tmp)
    return {name: figures["total"] for name, figures in result["arms"].items()}


def time_vocab_blocks(blocks: list[int], repeats: int = 12) -> dict[int, float]:
    """Median seconds of the streamed loss's forward and backward (256 tokens, SmolLM2's head) per block size."""
    import torch

    import lcsb_lightning.mebp.loss as loss

    torch.manual_seed(0)
    head = torch.nn.Linear(576, 49152, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 256, 576, requires_grad=True)
    labels = torch.randint(0, 49152, (1, 256))
    before = loss.VOCAB_BLOCK_ELEMENTS
    times: dict[int, list[float]] = {block: [] for block in blocks}
    try:
        for _ in range(repeats):
            for block in blocks:
                loss.VOCAB_BLOCK_ELEMENTS = block
                start = time.perf_counter()
                loss.chunked_lm_loss(hidden, head, labels, chunk_size=64).backward()
                times[block].append(time.perf_counter() - start)
                hidden.grad = None
    finally:
        loss.VOCAB_BLOCK_ELEMENTS = before
    return {block: statistics.median(ts[2:] if len(ts) > 2 else ts) for block, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="*", type=parse_arm, help="LABEL=OVERRIDE[,OVERRIDE...]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round: whole cycles of the policy")
    parser.add_argument("--task", default="pydoc")
    parser.add_argument("--vocab-blocks", type=int, nargs="*", default=[], help="time the streamed loss per block size")
    args = parser.parse_args(argv)
    if not args.arms and not args.vocab_blocks:
        parser.error("give arms, --vocab-blocks, or both")
    print(f"load average before: {os.getloadavg()}", flush=True)
    if args.vocab_blocks:
        seconds = time_vocab_blocks(args.vocab_blocks)
        first = seconds[args.vocab_blocks[0]]
        for block, value in seconds.items():
            print(f"vocabulary block {block:>9} weights: {value * 1000:.1f} ms ({value / first:.3f}x)")
    if args.arms:
        figures = time_arms(dict(args.arms), args.rounds, args.steps, args.task)
        first = next(iter(figures.values()))
        for name, value in figures.items():
            print(f"{name:>20}: {value:.3f} s/step ({value / first:.3f}x)")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
