"""``python -m benchmarks.gpu_check``: arguments, the CUDA preflight, the run, the table and the JSON."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .arms import ARMS, SHAPES, run
from .report import format_table, write_json

NO_CUDA_EXIT = 2


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value
    return parse


def parse_arms(text: str) -> tuple[str, ...]:
    """``"qlora,mebp"`` -> ``("qlora", "mebp")``; unknown, repeated or no arms raise ``ArgumentTypeError``."""
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"expected distinct arms out of {','.join(ARMS)}, got {text!r}")
    return arms


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; a bad argument exits with code 2 and argparse's message."""
    from lcsb_lightning.controller import BACKWARD_MODES

    p = argparse.ArgumentParser(prog="gpu_check", description="Peak CUDA memory and step time: qlora vs MeBP vs MeBP+LCSB.")
    p.add_argument("--steps", type=_at_least(1), default=20,
                   help="measured steps per arm (default 20; a multiple of 4 covers whole LCSB cycles, k = N/4)")
    p.add_argument("--warmup", type=_at_least(1), default=3, help="warm-up steps per arm (default 3)")
    p.add_argument("--arms", type=parse_arms, default=ARMS, help="comma-separated arms (default: all three)")
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON output path")
    p.add_argument("--seq-len", type=_at_least(2), default=256, help="tokens per sequence, batch 1 (default 256)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5_0.5b", help="model shape (default qwen2.5_0.5b)")
    p.add_argument("--lcsb-backward", choices=BACKWARD_MODES, default="all_reached",
                   help="LCSBCallback's backward for mebp_lcsb (default: the callback's, all_reached)")
    p.add_argument("--model-dir", type=Path, default=None, help="keep the random init here (reused if it has a config.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preflight", action="store_true", help="only check the arguments and CUDA, then exit")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": float32 test runs of the arm code
    return p.parse_args(argv)


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot run the check, or ``None`` (always ``None`` for a non-CUDA device)."""
    if not device.startswith("cuda") or torch.cuda.is_available():
        return None
    why = ("this torch is a CPU-only build (torch.version.cuda is None): install a CUDA build of torch"
           if torch.version.cuda is None else
           f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no device: check nvidia-smi, "
           "the driver and CUDA_VISIBLE_DEVICES")
    return f"gpu_check needs a CUDA device, but torch.cuda.is_available() is False; {why}."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check, print the table and write the JSON.

    Returns:
        0, or :data:`NO_CUDA_EXIT` (2, the reason on stderr) when there is no CUDA device.
    """
    args = parse_args(argv)
    problem = cuda_problem(args.device)
    if problem is not None:
        print(problem, file=sys.stderr)
        return NO_CUDA_EXIT
    if args.preflight:
        where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
        print(f"gpu_check: preflight ok ({where}, torch {torch.__version__}, CUDA {torch.version.cuda})")
        return 0
    result = run(args)
    print(format_table(result))
    write_json(result, args.out)
    print(f"\nJSON: {args.out}")
    return 0

