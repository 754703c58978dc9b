"""The formats table of docs/mebp.md: its errors are recomputed here, not copied."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _mebp_utils import gguf_model, write_tiny_gguf

from lcsb_lightning.bench import format_table
from lcsb_lightning.bench.format_table import ROWS, Row, relative_errors

DOCS = Path(__file__).resolve().parents[1] / "docs" / "mebp.md"


def _documented() -> dict[str, tuple[float, float]]:
    """``{label: (blocks %, embedding %)}`` from the table under "Formats" in docs/mebp.md."""
    found: dict[str, tuple[float, float]] = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in {row.label for row in ROWS}:
            blocks, embedding = (float(re.sub(r"[^0-9.]", "", c)) for c in cells[2:4])
            found[cells[0]] = (blocks, embedding)
    return found


def test_every_row_is_documented() -> None:
    assert set(_documented()) == {row.label for row in ROWS}


def test_errors_on_a_file_of_q4_1_blocks(tmp_path: Path) -> None:
    """On Q4_1 blocks, the asymmetric format at the blocks' group size and the file's own blocks lose
    nothing; every other format does, MeBP's int4 the most of the 4-bit ones measured here."""
    write_tiny_gguf(gguf_model("llama"), tmp_path / "tiny.gguf", "Q4_1", types={"token_embd.weight": "Q8_0"})
    errors = relative_errors(tmp_path / "tiny.gguf", (Row("int4", 64), Row("int4_asym", 32), Row("int4_asym", 64), Row("auto", 32)))
    assert errors["int4_asym/32"]["blocks"] == 0.0 and errors["gguf (auto)"] == {"blocks": 0.0, "embedding": 0.0}
    assert errors["int4/64"]["blocks"] > errors["int4_asym/64"]["blocks"] > 0.0
    assert 0.0 < errors["int4_asym/32"]["embedding"] < errors["int4/64"]["embedding"]


def test_bits_per_weight() -> None:
    assert [format_table.bits(row) for row in (Row("int4", 64), Row("int4_asym", 32), Row("nf4", 32))] == ["4.5", "5", "5"]
    assert format_table.bits(Row("auto", 32)) == "5 (Q4_1) / 8.5 (Q8_0)"


@pytest.mark.slow
def test_documented_errors_are_the_measured_ones() -> None:
    """All 210 block matrices and the embedding of the real SmolLM2-135M GGUF (about two minutes)."""
    from lcsb_lightning.recipes.models import smollm2_gguf_path

    torch.set_num_threads(2)
    measured = relative_errors(smollm2_gguf_path())
    for label, (blocks, embedding) in _documented().items():
        assert (round(100 * measured[label]["blocks"], 2), round(100 * measured[label]["embedding"], 2)) == (blocks, embedding), label
