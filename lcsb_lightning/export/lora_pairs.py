"""A peft LoRA adapter as llama.cpp applies one: pairs of GGUF tensors named after the base file's tensors.

llama.cpp adds ``scale · B (A x)`` to a base tensor's product, with ``scale = alpha / r`` read from one
``adapter.lora.alpha`` for the whole file and ``r`` from each pair's shape (``src/llama-graph.cpp``).
peft's scale is per module (``lora_alpha / r``, ``lora_alpha / sqrt(r)`` with rsLoRA, ``rank_pattern`` and
``alpha_pattern`` per module): the file gets the most common module's ``alpha · r``-equivalent, and a module
whose scale differs has the ratio folded into its B. llama.cpp's converter stores a llama file's Q and K
rows in rotary order (each head's two halves interleaved) and transformers' loader undoes that when it
reads the base model; B's rows, which are the base tensor's rows, get the converter's permutation.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

if TYPE_CHECKING:
    from lcsb_lightning.mebp._internal.gguf_file import GGUFFile


@dataclass(frozen=True)
class LoraPair:
    """One adapted base tensor: ``gguf_name`` (e.g. ``blk.0.attn_q.weight``), ``a`` ``(r, in)`` and ``b``
    ``(out, r)`` as float32 arrays in the file's row order, ``b`` already carrying any scale folded in."""

    module_name: str
    gguf_name: str
    a: np.ndarray
    b: np.ndarray


@dataclass(frozen=True)
class GGUFLora:
    """An adapter ready to write: its pairs and the file's ``adapter.lora.alpha``."""

    architecture: str
    alpha: float
    pairs: tuple[LoraPair, ...]


def _lora_layers(model: nn.Module, adapter_name: str) -> dict[str, nn.Module]:
    """``{base model module name: peft LoRA layer}`` of ``adapter_name`` (names relative to the base model)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name: module for name, module in base.named_modules()
            if isinstance(module, LoraLayer) and (adapter_name in module.lora_A or adapter_name in module.lora_embedding_A)}


def _config_refusals(model: nn.Module, adapter_name: str) -> list[str]:
    configs = getattr(model, "peft_config", None)
    config = configs.get(adapter_name) if isinstance(configs, dict) else None
    if config is None:
        return []
    refusals = []
    if getattr(config, "modules_to_save", None):
        refusals.append(f"`modules_to_save={list(config.modules_to_save)}` trains whole copies of modules; "
                        "a GGUF adapter holds LoRA pairs only")
    if getattr(config, "trainable_token_indices", None):
        refusals.append("`trainable_token_indices` trains embedding rows (added tokens); a GGUF adapter cannot carry them")
    if getattr(config, "bias", "none") != "none":
        refusals.append(f"`bias={config.bias!r}` trains biases; a GGUF adapter holds LoRA pairs only (use bias='none')")
    return refusals


def _layer_refusals(name: str, layer: nn.Module, adapter_name: str) -> list[str]:
    if adapter_name in layer.lora_embedding_A:
        return [f"`{name}`: an embedding adapter; llama.cpp's adapter loader takes LoRA on matrices only here"]
    refusals = []
    if layer.use_dora.get(adapter_name, False):
        refusals.append(f"`{name}`: DoRA's magnitude vector has no GGUF form (llama.cpp applies W + s·BA)")
    if getattr(layer, "lora_bias", {}).get(adapter_name, False):
        refusals.append(f"`{name}`: `lora_bias=True` adds a bias to B; llama.cpp's LoRA has none")
    if not isinstance(layer.lora_A[adapter_name], nn.Linear):
        refusals.append(f"`{name}`: LoRA on a {type(layer.get_base_layer()).__name__}, not a Linear layer")
    if getattr(layer, "fan_in_fan_out", False):
        refusals.append(f"`{name}`: a fan-in-fan-out (Conv1D) layer; the GGUF architectures here use Linear layers")
    return refusals


def check_gguf_lora(model: nn.Module, base: str | os.PathLike[str] | GGUFFile, adapter_name: str = "default") -> None:
    """Refuse, before any training, an adapter that llama.cpp could not apply to ``base`` as trained; arguments
    as in :func:`gguf_lora`. Reads the file's tensor table only and copies no weight.

    Raises:
        ValueError: as :func:`gguf_lora`.
    """
    with _open(base) as reader:
        _checked(model, reader, adapter_name)


def gguf_lora(model: nn.Module, base: str | os.PathLike[str] | GGUFFile, adapter_name: str = "default") -> GGUFLora:
    """The pairs of ``model``'s LoRA adapter ``adapter_name`` for the base GGUF file ``base``.

    Args:
        model: A ``peft.PeftModel`` (or a model holding peft LoRA layers) over the base model of ``base``.
        base: The base model's GGUF file (path or an open :class:`GGUFFile`): it gives the tensor names,
            shapes, architecture and head counts; its weights are not read.
        adapter_name: The peft adapter to export.

    Raises:
        ValueError: every reason llama.cpp could not apply the adapter as trained, in one message (the LM
            head on a tied embedding, embedding adapters, added tokens, DoRA, trained biases, a vocabulary
            that differs from the file's), or no LoRA layer at all.
    """
    with _open(base) as reader:
        layers, names = _checked(model, reader, adapter_name)
        return _pairs(layers, names, reader, adapter_name)


@contextlib.contextmanager
def _open(base: str | os.PathLike[str] | GGUFFile) -> Iterator[GGUFFile]:
    """``base`` as an open file; one opened here is closed on the way out (its memory map with it)."""
    from lcsb_lightning.mebp._internal.gguf_file import GGUFFile
    from lcsb_lightning.mebp._internal.sources import open_gguf

    if isinstance(base, GGUFFile):
        yield base
        return
    with open_gguf(base) as reader:
        yield reader


def _checked(model: nn.Module, reader: GGUFFile, adapter_name: str) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """``(LoRA layers, their base tensor names)``, or a ValueError listing every refusal."""
    layers = _lora_layers(model, adapter_name)
    if not layers:
        raise ValueError(f"The model has no LoRA layer of adapter {adapter_name!r}: nothing to export.")
    refusals = _config_refusals(model, adapter_name)
    for name, layer in layers.items():
        refusals.extend(_layer_refusals(name, layer, adapter_name))
    names = _tensor_names(model, layers, reader, refusals)
    _check_vocabulary(model, reader, refusals)
    if refusals:
        raise ValueError("This adapter cannot be written as a GGUF adapter that llama.cpp applies as trained:\n- "
                         + "\n- ".join(refusals))
    return layers, names


def _tensor_names(model: nn.Module, layers: dict[str, nn.Module], reader: GGUFFile, refusals: list[str]) -> dict[str, str]:
    """``{module name: base tensor name}``; a module with no 2-D tensor of its shape in the file is refused."""
    import gguf

    from lcsb_lightning.mebp._internal.sources import gguf_tensor_name, gguf_architecture

    arch = gguf_architecture(reader)
    blocks = int(reader.get_field(f"{arch}.block_count").contents())
    arch_id = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_id, blocks)
    shapes = {tensor.name: tuple(int(d) for d in tensor.shape) for tensor in reader.tensors}
    names = {}
    for name, layer in layers.items():
        tensor = gguf_tensor_name(name_map, f"{name}.weight")
        if tensor is None or tensor not in shapes:
            why = ("the base file ties the LM head to `token_embd.weight` (it has no `output.weight`)"
                   if tensor == "output.weight" else f"the base file has no tensor `{tensor}` for it")
            refusals.append(f"`{name}`: {why}, so llama.cpp would find nothing to apply it to")
            continue
        base_layer = layer.get_base_layer()
        wanted = (int(base_layer.in_features), int(base_layer.out_features)) if hasattr(base_layer, "in_features") else None
        if wanted is not None and shapes[tensor] != wanted:
            refusals.append(f"`{name}`: the base file's `{tensor}` has shape {shapes[tensor]} (GGUF order), the layer {wanted}")
        names[name] = tensor
    return names


def _check_vocabulary(model: nn.Module, reader: GGUFFile, refusals: list[str]) -> None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    token_embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embeddings is None or token_embd is None:
        return
    rows = int(token_embd.shape[1])
    if embeddings.weight.shape[0] != rows:
        refusals.append(f"the model's vocabulary has {embeddings.weight.shape[0]} tokens, the base file's {rows} "
                        "(added tokens): llama.cpp would run the adapter with the file's vocabulary")


def _pairs(layers: dict[str, nn.Module], names: dict[str, str], reader: GGUFFile, adapter_name: str) -> GGUFLora:
    from lcsb_lightning.mebp._internal.sources import gguf_architecture, rotary_heads, rotary_order

    arch = gguf_architecture(reader)
    permuted = rotary_heads(reader)  # as GGUFSource reads the base
    ranks = {name: int(layer.r[adapter_name]) for name, layer in layers.items()}
    scales = {name: float(layer.scaling[adapter_name]) for name, layer in layers.items()}
    alpha = Counter(scales[n] * ranks[n] for n in layers).most_common(1)[0][0]
    if alpha == 0:
        raise ValueError("The adapter's scale is 0 (lora_alpha=0): llama.cpp reads alpha 0 as 'scale 1'.")
    pairs = []
    for name, layer in layers.items():
        a = layer.lora_A[adapter_name].weight.detach().float().cpu().numpy()
        b = layer.lora_B[adapter_name].weight.detach().float().cpu().numpy()
        fold = scales[name] / (alpha / ranks[name])
        if fold != 1.0:
            b = b * np.float32(fold)
        n_head = next((n for key, n in permuted.items() if key in names[name]), None)
        if n_head is not None:
            b = rotary_order(b, n_head)
        pairs.append(LoraPair(name, names[name], np.ascontiguousarray(a), np.ascontiguousarray(b)))
    return GGUFLora(arch, float(alpha), tuple(pairs))
