"""Weight sources for :func:`load_compressed`: random init, a safetensors folder, a GGUF file.

A source yields one tensor (or a range of its rows) at a time by Hugging Face parameter name, so
the loader never holds more than one float tensor, or one row chunk of a large one.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Protocol

import torch
from torch import nn


class WeightSource(Protocol):
    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of parameter ``name`` (the whole tensor for 1-D shapes) as float32."""


class RandomSource:
    """Deterministic random init: normal(0, ``std``) for matrices, ones for norm weights, zeros for biases."""

    def __init__(self, std: float = 0.02, seed: int = 0) -> None:
        self.std = std
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        if len(shape) == 1:
            return torch.zeros(shape) if name.endswith("bias") else torch.ones(shape)
        if start == 0 or name not in self._generators:  # rows are requested in order
            self._generators[name] = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        out = torch.empty(stop - start, *shape[1:])
        return out.normal_(0.0, self.std, generator=self._generators[name])


class SafetensorsSource:
    """A Hugging Face checkpoint folder (``model.safetensors`` or a sharded index)."""

    def __init__(self, folder: str, aliases: dict[str, str] | None = None) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            self.files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        else:
            single = os.path.join(folder, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"No `model.safetensors` or `model.safetensors.index.json` in {folder!r}.")
            with safe_open(single, "pt") as handle:
                self.files = {name: single for name in handle.keys()}
        self.aliases = aliases or {}

    def _resolve(self, name: str) -> str:
        if name in self.files:
            return name
        alias = self.aliases.get(name)
        if alias in self.files:
            return alias
        raise KeyError(f"Parameter `{name}` is not in the checkpoint ({len(self.files)} tensors).")

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        key = self._resolve(name)
        with self._safe_open(self.files[key], "pt") as handle:
            sliced = handle.get_slice(key)
            tensor = sliced[:] if len(shape) == 1 else sliced[start:stop]
        return tensor.float()


class GGUFSource:
    """A GGUF file; each tensor is dequantized on its own with the ``gguf`` package."""

    def __init__(self, path: str, model: nn.Module) -> None:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        self._gguf = gguf
        self.reader = gguf.GGUFReader(path)
        config = model.config
        self.processor = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)(config=config.to_dict())
        hf_to_gguf = {hf: gg for gg, hf in get_gguf_hf_weights_map(model, self.processor).items()}
        by_name = {tensor.name: tensor for tensor in self.reader.tensors}
        self.tensors = {hf: by_name[gg] for hf, gg in hf_to_gguf.items() if gg in by_name}
        self._cache: tuple[str, torch.Tensor] | None = None

    def rows(self, name: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"Parameter `{name}` has no tensor in the GGUF file.")
        if self._cache is None or self._cache[0] != name:
            tensor = self.tensors[name]
            weights = self._gguf.dequantize(tensor.data, tensor.tensor_type)
            weights = self.processor.process(weights=weights, name=tensor.name).weights
            self._cache = (name, torch.from_numpy(weights.copy()).float().reshape(shape))
        full = self._cache[1]
        if len(shape) == 1 or stop >= shape[0]:
            self._cache = None  # last chunk: free the dequantized tensor
        return full if len(shape) == 1 else full[start:stop]
