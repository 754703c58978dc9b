"""``load_compressed``: build a model directly in MeBP's compressed form, one tensor at a time, on a meta skeleton.

Besides the compressed model and its float parameters, loading holds one float32 row chunk of at most
``LOAD_CHUNK_ELEMENTS`` weights and what the source needs to produce it (sources.py).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from lcsb_lightning.blocks import find_blocks
from lcsb_lightning.mebp.config import MeBPConfig, build_config
from lcsb_lightning.mebp.convert import check_group_sizes, finish_conversion, find_targets, install_twin
from lcsb_lightning.mebp._internal.formats import get_format
from lcsb_lightning.mebp._internal.stored import Packed, StoredFormat, select_rows
from lcsb_lightning.mebp._internal.heap import map_large_allocations, trim_heap
from lcsb_lightning.mebp._internal.storage import MappedWeights, maps_at_conversion
from lcsb_lightning.mebp._internal.sources import FLOAT_TYPES, GGUFSource, RandomSource, SafetensorsSource, WeightSource, open_gguf

if TYPE_CHECKING:
    from lcsb_lightning.mebp._internal.gguf_file import GGUFFile as GGUFReader

log = logging.getLogger(__name__)

#: Largest number of float weights quantized at once while loading.
LOAD_CHUNK_ELEMENTS = 1 << 18

Source = Union[str, os.PathLike, Any]  # a folder, a .gguf path, or a transformers PretrainedConfig


def _meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter on the meta device and every buffer real (rotary ``inv_freq``, Gemma's
    ``embed_scale``: computed in ``__init__``)."""
    from accelerate import init_empty_weights  # a dependency of peft
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # the context re-creates re-assigned parameters, which unties them
    return model.eval()


@dataclass(frozen=True)
class _Target:
    """How one weight is stored: its format and group size, and whether the source's own blocks are kept."""

    fmt: StoredFormat
    group_size: int
    native: bool = False


def _target_format(source: WeightSource, name: str, config: MeBPConfig) -> _Target:
    """A GGUF tensor whose blocks a stored format holds keeps them with ``fmt="auto"``; else ``config``'s format."""
    if config.fmt == "auto" and isinstance(source, GGUFSource):
        native = source.native_format(name)
        if native is not None:
            return _Target(native, native.group_size, native=True)
    return _Target(get_format(config.fmt), config.group_size)


def _packed(source: WeightSource, name: str, shape: torch.Size, target: _Target, slot: Packed | None,
            error: list[float] | None = None) -> Packed:
    """The compressed tensor, written into ``slot`` (if given) one row chunk at a time; ``error`` adds up the
    squared round-trip error and the squared norm of the float rows."""
    rows, cols = shape
    if slot is None:
        (slot,) = target.fmt.allocate([(rows, cols)], target.group_size)
    step = max(1, LOAD_CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        part = select_rows(slot, slice(start, stop))
        if target.native:
            assert isinstance(source, GGUFSource)
            source.packed_rows_into(name, shape, start, stop, part)
            continue
        chunk = source.rows(name, shape, start, stop)
        target.fmt.quantize_into(chunk, target.group_size, part)
        if error is not None:
            error[0] += float(target.fmt.dequantize(part, target.group_size, torch.float32).sub_(chunk).square().sum())
            error[1] += float(chunk.square().sum())
    return slot


def _allocate(shapes: dict[int, tuple[int, int]], targets: dict[int, _Target]) -> dict[int, Packed]:
    """One buffer per stored format (see StoredFormat.allocate), a slot per weight."""
    by_format: dict[_Target, list[int]] = defaultdict(list)
    for key, target in targets.items():
        by_format[target].append(key)
    return {key: slot for target, keys in by_format.items()
            for key, slot in zip(keys, target.fmt.allocate([shapes[k] for k in keys], target.group_size))}


def _describe(targets: dict[int, _Target], source_types: dict[int, str]) -> str:
    """E.g. ``168 x q5_0/32 (GGUF Q5_0 as it is), 16 x q4_k/32 (GGUF Q4_K as it is), 1 x int4_asym/32 (from F16)``."""
    counts = Counter((t.fmt.name, t.group_size, t.native, source_types.get(key)) for key, t in targets.items())
    return ", ".join(f"{n} x {fmt}/{group} (" + (f"GGUF {kind} as it is" if native else f"from {kind or 'float'}") + ")"
                     for (fmt, group, native, kind), n in counts.items())


def _float_param(source: WeightSource, name: str, param: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    data = source.rows(name, param.shape, 0, param.shape[0] if param.dim() else 1).reshape(param.shape)
    return nn.Parameter(data.to(dtype), requires_grad=param.requires_grad)


def _open(source: Source, gguf_file: str | None, model_config: Any, dtype: torch.dtype,
          seed: int) -> tuple[nn.Module, WeightSource, str | None, GGUFReader | None]:
    """``(meta model, its weight source, path, the open GGUF file or None)``; a GGUF's architecture is checked
    before transformers parses its config."""
    from transformers import AutoConfig, PretrainedConfig

    path, reader = None, None
    if isinstance(source, PretrainedConfig):
        model_config = source
    elif not isinstance(source, (str, os.PathLike)):
        raise TypeError("`source` must be a checkpoint folder, a .gguf file or a transformers config, got "
                        f"{type(source).__name__}.")
    else:
        path = os.path.join(os.fspath(source), gguf_file) if gguf_file is not None else os.fspath(source)
        if path.endswith(".gguf"):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
            reader = open_gguf(path)  # fails on an unsupported architecture, before any other work
            folder, name = os.path.split(os.path.abspath(path))
            model_config = model_config or AutoConfig.from_pretrained(folder, gguf_file=name)
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"`source={path!r}` is neither a checkpoint folder nor a .gguf file.")
        else:
            model_config = model_config or AutoConfig.from_pretrained(path)
    model = _meta_model(model_config, dtype)
    if reader is not None:
        return model, GGUFSource(reader, model), path, reader  # maps names, checks tensor types and shapes
    if path is None:
        return model, RandomSource(std=getattr(model_config, "initializer_range", 0.02), seed=seed), None, None
    names = {id(p): n for n, p in model.named_parameters()}
    tied = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n != names[id(p)]}
    return model, SafetensorsSource(path, aliases={**tied, **{v: k for k, v in tied.items()}}), path, None


def _load_float_params(model: nn.Module, source: WeightSource, names: dict[int, str], dtype: torch.dtype) -> None:
    """Every parameter still on the meta device, read from ``source`` (tied ones once)."""
    loaded: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in loaded:
                    loaded[id(param)] = _float_param(source, names[id(param)], param, dtype)
                module._parameters[pname] = loaded[id(param)]


def load_float(source: Source, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
               model_config: Any = None) -> nn.Module:
    """Load a causal LM in float, one tensor at a time, from the sources :func:`load_compressed` reads
    (a GGUF equal to transformers' ``from_pretrained(..., gguf_file=...)``, with no second copy in memory).
    Arguments as in :func:`load_compressed`. Returns the model in eval mode.

    Example::

        >>> from transformers import LlamaConfig
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, vocab_size=128)
        >>> load_float(config).model.embed_tokens.weight.dtype
        torch.float32
    """
    model, weight_source, _, reader = _open(source, gguf_file, model_config, dtype, seed)
    _load_float_params(model, weight_source, {id(p): n for n, p in model.named_parameters()}, dtype)
    if reader is not None:
        reader.close()
    trim_heap()
    return model


def load_compressed(source: Source, config: MeBPConfig | None = None, *, gguf_file: str | None = None,
                    dtype: torch.dtype = torch.float32, seed: int = 0, model_config: Any = None,
                    **options: Any) -> nn.Module:
    """Load a causal LM straight into compressed form, ready for LoRA and ``QuantizedMeBP``.

    Args:
        source: A Hugging Face checkpoint folder (safetensors), a ``.gguf`` file (or its folder with
            ``gguf_file``), or a ``PretrainedConfig`` for a random init (memory and speed studies).
        config: The options (:class:`~lcsb_lightning.mebp.MeBPConfig`; its defaults without one). With
            ``weights="mmap"`` each tensor goes to its file as soon as it is compressed. With ``fmt="auto"``
            a GGUF's tensors keep their blocks where a stored format holds them (Q4_0-Q8_0, Q2_K-Q6_K);
            other quantized ones are quantized again (warned, with the error).
        gguf_file: File name of the GGUF inside the ``source`` folder.
        dtype: Dtype of the float parameters that stay uncompressed (norms, biases).
        seed: Seed of the random init.
        model_config: The model's transformers config, where ``source`` is a file or folder (None: read from
            it; for a GGUF transformers parses its whole metadata, seconds and 150 MB for SmolLM2's).
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
    model, weight_source, path, reader = _open(source, gguf_file, model_config, dtype, seed)
    targets = find_targets(model, find_blocks(model), config)
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight keeps its first name
    unique = {id(m.weight): tuple(m.weight.shape) for m in targets.values()}
    formats = {key: _target_format(weight_source, names[key], config) for key in unique}
    check_group_sizes(targets, {name: formats[id(m.weight)].group_size for name, m in targets.items()})
    source_types = ({key: weight_source.tensor_type(names[key]) for key in unique}
                    if isinstance(weight_source, GGUFSource) else {})
    log.info("load_compressed: %s: %s", path or "random init", _describe(formats, source_types))
    requantized = {key for key, kind in source_types.items() if not formats[key].native and kind not in FLOAT_TYPES}
    error = [0.0, 0.0]

    shared: dict[int, Packed] = {}
    store = MappedWeights(config.offload_dir) if maps_at_conversion(config.weights, torch.device("cpu"), config.offload_dir) else None
    # In RAM, all codes of a format share one allocation (see allocate_packed); mapped, each goes to its file.
    slots = _allocate(unique, formats) if store is None else {}
    compressed: dict[str, nn.Module] = {}
    for target_name, module in targets.items():
        key = id(module.weight)
        target = formats[key]
        if key not in shared:
            measured = error if key in requantized else None
            shared[key] = _packed(weight_source, names[key], module.weight.shape, target, slots.get(key), measured)
            if store is not None:
                shared[key] = store.map(shared[key])
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias = _float_param(weight_source, names[id(module.bias)], module.bias, dtype)
        compressed[target_name] = install_twin(model, target_name, shared[key], target.fmt, target.group_size, dtype)
    _load_float_params(model, weight_source, names, dtype)
    if requantized:
        _warn_requantized({key: source_types[key] for key in requantized}, formats, error, path)
    del weight_source, shared
    if reader is not None:
        reader.close()
    trim_heap()  # the float row chunks were freed; do not keep their pages resident
    return finish_conversion(model, find_blocks(model), compressed, config, store, path)


def _warn_requantized(source_types: dict[int, str], formats: dict[int, _Target], error: list[float], path: str | None) -> None:
    by_type = ", ".join(f"{n} x {kind}" for kind, n in sorted(Counter(source_types.values()).items()))
    into = ", ".join(sorted({f"{formats[key].fmt.name}/{formats[key].group_size}" for key in source_types}))
    relative = (error[0] / error[1]) ** 0.5 if error[1] > 0 else 0.0
    warnings.warn(f"load_compressed: {len(source_types)} quantized GGUF tensor(s) of {path} have no stored format that "
                  f"holds them as they are ({by_type}) and were quantized a second time, to {into}: relative error "
                  f"{relative:.4f} (root of the summed squared error over the summed squared weights, against the "
                  "file's dequantized weights).", UserWarning, stacklevel=3)
