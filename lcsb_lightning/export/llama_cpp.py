"""llama.cpp as the judge of the files :mod:`lcsb_lightning.export` writes (``pip install lcsb-lightning[llama]``).

``llama-cpp-python`` 0.3.36 (later versions dropped ``lora_path``) runs a GGUF file with or without an
adapter and returns every position's logits, for tokens given as ids, so both sides see the same input.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

#: llama.cpp's ``ggml_type`` of an F32 key/value cache: its default F16 cache alone moves SmolLM2's logits
#: by 2.5e-2, which would hide the differences the comparison is for.
_GGML_TYPE_F32 = 0


def load_llama(model_path: str | os.PathLike[str], lora_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """``llama_cpp.Llama(model_path, lora_path=lora_path, **kwargs)`` with llama.cpp's extra CPU buffer types (the
    repacked and AMX layouts) off: with them, 0.3.36 crashed in ``decode`` on a Q4_1 file on an AVX512/AMX machine.

    Example::

        >>> llm = load_llama("SmolLM2-135M-Instruct.Q4_1.gguf", "adapter.gguf")  # doctest: +SKIP
        >>> llm.create_chat_completion([{"role": "user", "content": "What is 12 * 7?"}])  # doctest: +SKIP
    """
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_module.llama_cpp.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = without_extra_buffers  # read in Llama.__init__
    try:
        return llama_cpp.Llama(model_path=os.fspath(model_path), lora_path=os.fspath(lora_path) if lora_path else None,
                               **{"verbose": False, **kwargs})
    finally:
        llama_module.llama_cpp.llama_model_default_params = default


def llama_cpp_logits(model_path: str | os.PathLike[str], tokens: list[int], lora_path: str | os.PathLike[str] | None = None,
                     threads: int | None = None) -> np.ndarray:
    """llama.cpp's logits ``(len(tokens), vocab)`` for ``tokens`` through ``model_path`` (and the adapter ``lora_path``).

    Example::

        >>> logits = llama_cpp_logits("SmolLM2-135M-Instruct.Q4_1.gguf", [1, 2, 3], "adapter.gguf")  # doctest: +SKIP
    """
    llm = load_llama(model_path, lora_path, logits_all=True, n_ctx=max(len(tokens), 8), n_batch=max(len(tokens), 8),
                     n_threads=threads or os.cpu_count(), type_k=_GGML_TYPE_F32, type_v=_GGML_TYPE_F32)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def requantize(source: str | os.PathLike[str], target: str | os.PathLike[str], ftype: str) -> Path:
    """Write ``source`` as llama.cpp's own quantizer writes it with file type ``ftype`` (``"ALL_F32"``,
    ``"MOSTLY_Q4_K_M"``, ... as in ``llama_cpp.LLAMA_FTYPE_*``), re-quantizing quantized tensors.

    Raises:
        ValueError: an unknown ``ftype``.
        RuntimeError: llama.cpp's quantizer failed.
    """
    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}", None)
    if code is None:
        raise ValueError(f"`ftype={ftype!r}` is not a llama.cpp file type (llama_cpp.LLAMA_FTYPE_*).")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(os.fspath(source).encode(), os.fspath(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype} (status {status}).")
    return Path(target)


def token_nll(logits: np.ndarray, tokens: list[int]) -> float:
    """Mean negative log-likelihood of ``tokens[1:]`` under ``logits[:-1]`` (float64)."""
    scores = logits[:-1].astype(np.float64)
    scores -= scores.max(axis=1, keepdims=True)
    log_probs = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(tokens) - 1), tokens[1:]].mean())
