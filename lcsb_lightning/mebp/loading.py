"""``load_compressed``: build a model directly in MeBP's compressed form, one tensor at a time.

The model skeleton is created on the meta device; then every module to compress is built straight
from its source weight (quantized in row chunks, so not even the 150k-row embedding exists in float
at once), and the remaining small float parameters (norms, biases, ignored modules) are loaded.

What is bounded: besides the compressed model and the float parameters kept in float, loading holds
one float32 row chunk of at most ``LOAD_CHUNK_ELEMENTS`` weights (16 MiB) and its quantized parts,
plus what the source needs to produce that chunk. A GGUF file is memory-mapped: the packed bytes of
the tensor being read are file-backed pages (at most one tensor's packed size), and the heap holds
the chunk plus one ``gguf`` dequantize call on at most ``sources.DEQUANTIZE_ELEMENTS`` weights
(the file's parsed metadata, such as the tokenizer, stays open until the model is built).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from lcsb_lightning.blocks import find_blocks
from lcsb_lightning.mebp.config import MeBPConfig, build_config
from lcsb_lightning.mebp.convert import compressed_twin, finish_conversion, find_targets
from lcsb_lightning.mebp._internal.formats import Packed, allocate_packed, quantize_into
from lcsb_lightning.mebp._internal.heap import map_large_allocations, release_free_heap
from lcsb_lightning.mebp._internal.storage import MappedWeights, maps_at_conversion
from lcsb_lightning.mebp._internal.sources import GGUFSource, RandomSource, SafetensorsSource, WeightSource, open_gguf

if TYPE_CHECKING:
    from gguf import GGUFReader

#: Largest number of float weights quantized at once while loading.
LOAD_CHUNK_ELEMENTS = 1 << 18

Source = Union[str, os.PathLike, Any]  # a folder, a .gguf path, or a transformers PretrainedConfig


def _meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter on the meta device and every buffer real (rotary ``inv_freq``,
    Gemma's ``embed_scale``: small, computed in ``__init__`` and in no checkpoint)."""
    from accelerate import init_empty_weights  # a dependency of peft
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # the context re-creates re-assigned parameters, which unties them
    return model.eval()


def _packed(source: WeightSource, name: str, shape: torch.Size, fmt: str, group_size: int, slot: Packed | None) -> Packed:
    """The compressed tensor, written in place (into ``slot`` if given) one row chunk at a time."""
    rows, cols = shape
    if slot is None:
        (slot,) = allocate_packed([(rows, cols)], group_size)
    step = max(1, LOAD_CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        part = slot.codes[start:stop], slot.scales[start:stop]
        quantize_into(source.rows(name, shape, start, stop), fmt, group_size, *part)
    return slot


def _float_param(source: WeightSource, name: str, param: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    data = source.rows(name, param.shape, 0, param.shape[0] if param.dim() else 1).reshape(param.shape)
    return nn.Parameter(data.to(dtype), requires_grad=param.requires_grad)


def _resolve(source: Source, gguf_file: str | None) -> tuple[Any, str, str | None, GGUFReader | None]:
    """``(config, kind, path, reader)``: kind is ``"random"``, ``"safetensors"`` or ``"gguf"``; reader is
    the open ``gguf.GGUFReader`` of a GGUF file (its architecture checked before the config is parsed),
    else ``None``."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source, "random", None, None
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"`source` must be a checkpoint folder, a .gguf file or a transformers config, got {type(source).__name__}."
        )
    path = os.fspath(source)
    if gguf_file is not None:
        path = os.path.join(path, gguf_file)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
        reader = open_gguf(path)  # fails on an unsupported architecture, before any other work
        folder, name = os.path.split(os.path.abspath(path))
        return AutoConfig.from_pretrained(folder, gguf_file=name), "gguf", path, reader
    if not os.path.isdir(path):
        raise FileNotFoundError(f"`source={path!r}` is neither a checkpoint folder nor a .gguf file.")
    return AutoConfig.from_pretrained(path), "safetensors", path, None


def load_compressed(
    source: Source,
    config: MeBPConfig | None = None,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **options: Any,
) -> nn.Module:
    """Load a causal LM straight into compressed form, ready for LoRA and ``QuantizedMeBP``.

    Args:
        source: A Hugging Face checkpoint folder (safetensors), a ``.gguf`` file (or its folder with
            ``gguf_file``), or a ``PretrainedConfig`` for a random init (memory and speed studies).
        config: The options (:class:`~lcsb_lightning.mebp.MeBPConfig`; its defaults without one). With
            ``weights="mmap"`` each tensor goes to its file as soon as it is compressed, so the
            compressed model never is resident as a whole, not even while loading.
        gguf_file: File name of the GGUF inside the ``source`` folder.
        dtype: Dtype of the float parameters that stay uncompressed (norms, biases).
        seed: Seed of the random init.
        **options: :class:`~lcsb_lightning.mebp.MeBPConfig` fields, as in :func:`~lcsb_lightning.mebp.apply_mebp`.

    Returns:
        The model, in eval mode, with the state :func:`~lcsb_lightning.mebp.mebp_state` reports;
        a ``QuantizedMeBP`` plugin leaves it as it is.

    Example::

        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, vocab_size=128)
        >>> model = load_compressed(config, fmt="int4", group_size=32)
        >>> type(model.lm_head).__name__
        'CompressedLinear'
    """
    config = build_config(config, options, "load_compressed")
    if config.map_large_allocations:  # before the loading's chunks: the heap must not hold them to serve later
        map_large_allocations()
    model_config, kind, path, reader = _resolve(source, gguf_file)
    model = _meta_model(model_config, dtype)
    found = find_blocks(model)
    targets = find_targets(model, found, config)
    fmt, group_size = config.fmt, config.group_size
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight keeps its first name
    weight_source: WeightSource
    if kind == "random":
        weight_source = RandomSource(std=getattr(model_config, "initializer_range", 0.02), seed=seed)
    elif kind == "safetensors":
        tied = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n != names[id(p)]}
        weight_source = SafetensorsSource(path, aliases={**tied, **{v: k for k, v in tied.items()}})
    else:
        weight_source = GGUFSource(reader, model)  # maps names, checks tensor types and shapes

    shared: dict[int, Packed] = {}
    store = MappedWeights(config.offload_dir) if maps_at_conversion(config.weights, torch.device("cpu"), config.offload_dir) else None
    unique = {id(m.weight): tuple(m.weight.shape) for m in targets.values()}
    # In RAM, all codes share one allocation (see allocate_packed); mapped, each goes to its file.
    slots = dict(zip(unique, allocate_packed(list(unique.values()), group_size))) if store is None else {}
    compressed: dict[str, nn.Module] = {}
    for target_name, module in targets.items():
        key = id(module.weight)
        if key not in shared:
            shared[key] = _packed(weight_source, names[key], module.weight.shape, fmt, group_size, slots.get(key))
            if store is not None:
                shared[key] = store.map(shared[key])
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias = _float_param(weight_source, names[id(module.bias)], module.bias, dtype)
        new = compressed_twin(module, shared[key], fmt, group_size, dtype)
        parent, _, child = target_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        compressed[target_name] = new
    loaded: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in loaded:
                    loaded[id(param)] = _float_param(weight_source, names[id(param)], param, dtype)
                module._parameters[pname] = loaded[id(param)]
    del weight_source, reader, shared, loaded
    release_free_heap()  # the float row chunks were freed; do not keep their pages resident
    return finish_conversion(model, find_blocks(model), compressed, config, store)
