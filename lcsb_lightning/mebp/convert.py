"""``apply_mebp``: compress a model's frozen Linears (and embeddings), install checkpointing/offload."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from lcsb_lightning.blocks import BlocksSpec, find_blocks, unwrap_model
from lcsb_lightning.mebp._internal.checkpoint import install_block_wrappers
from lcsb_lightning.mebp._internal.formats import get_format
from lcsb_lightning.mebp._internal.stored import Packed, StoredFormat
from lcsb_lightning.mebp._internal.heap import map_large_allocations
from lcsb_lightning.mebp._internal.offload import MmapOffload
from lcsb_lightning.mebp._internal.stats import MeBPStats
from lcsb_lightning.mebp._internal.storage import MappedWeights, maps_at_conversion
from lcsb_lightning.mebp._internal.workspace import DecompressionWorkspace
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp.config import MeBPConfig, build_config

#: Attribute under which ``apply_mebp`` records what it did on the model.
STATE_ATTR = "_mebp_state"


@dataclass
class MeBPState:
    """What :func:`apply_mebp` installed on a model (``model._mebp_state``): its ``config``, its ``blocks``,
    each compressed module by qualified name, and the ``source`` file :func:`load_compressed` read, if any."""

    config: MeBPConfig
    blocks: list[nn.Module]
    compressed_modules: dict[str, nn.Module] = field(default_factory=dict)
    offload: MmapOffload | None = None
    weight_store: MappedWeights | None = None
    stats: MeBPStats = field(default_factory=MeBPStats)
    workspace: DecompressionWorkspace = field(default_factory=DecompressionWorkspace)
    source: str | None = None

    def close(self) -> None:
        """Remove the offload and weight directories (the compressed layers stay usable)."""
        if self.offload is not None:
            self.offload.close()
        if self.weight_store is not None:
            self.weight_store.close()


def _ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    dotted = f".{name}."
    return any(f".{ignored}." in dotted for ignored in ignore_modules)


def _adapter_module_ids(model: nn.Module) -> set[int]:
    """Modules inside peft adapter containers (LoRA A/B): never compressed."""
    containers = (getattr(module, attr, None) for module in model.modules()
                  for attr in getattr(module, "adapter_layer_names", ()))
    return {id(m) for container in containers if isinstance(container, nn.Module) for m in container.modules()}


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    for module in model.modules():
        base = unwrap_model(module)
        get_in, get_out = getattr(base, "get_input_embeddings", None), getattr(base, "get_output_embeddings", None)
        if callable(get_in) and callable(get_out):
            try:
                return get_in(), get_out()
            except (NotImplementedError, AttributeError):
                return None, None
    return None, None


def _is_scaled_embedding(module: nn.Module) -> bool:
    """Hugging Face's ``*ScaledWordEmbedding`` (Gemma 3, Bart, ...): a lookup times ``embed_scale``."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and hasattr(module, "embed_scale"))


def _same_computation(module: nn.Module) -> bool:
    """Whether the compressed twin computes what ``module`` computes (its class keeps the base forward)."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    return type(module).forward is nn.Embedding.forward or _is_scaled_embedding(module)


def _candidates(model: nn.Module, blocks: list[nn.Module], compress_embeddings: bool) -> list[nn.Module]:
    """Every Linear in the blocks and (optionally) the input embedding and LM head, by ``isinstance``."""
    found: list[nn.Module] = [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    if compress_embeddings:
        found += [m for m in _embeddings(model) if isinstance(m, (nn.Linear, nn.Embedding))]
    return found


def find_targets(model: nn.Module, blocks: list[nn.Module], config: MeBPConfig) -> dict[str, nn.Module]:
    """The modules to compress by qualified name: the candidates :func:`apply_mebp` describes, less the ones
    it never compresses (warned where the user may not expect it)."""
    ignore_modules = config.ignore_modules
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    excluded = _adapter_module_ids(model)
    # A model whose parameters are all trainable has not been set up for fine-tuning yet (it comes
    # straight from from_pretrained): compressing freezes it. Otherwise requires_grad is the user's choice.
    set_up = any(not p.requires_grad for p in model.parameters() if p.is_floating_point())  # not quantized ones
    targets: dict[str, nn.Module] = {}
    trainable: list[str] = []
    different: list[str] = []
    for module in _candidates(model, blocks, config.compress_embeddings):
        name = names.get(id(module))
        if name is None or id(module) in excluded or name in targets or _ignored(name, ignore_modules):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not (weight.is_floating_point() or weight.is_meta):
            continue  # already quantized
        if not _same_computation(module):
            different.append(f"{name} ({type(module).__name__})")
        elif set_up and weight.requires_grad:
            trainable.append(name)
        else:
            targets[name] = module
    if different:
        warnings.warn(f"QuantizedMeBP left {len(different)} module(s) uncompressed whose class overrides `forward`: "
                      f"{', '.join(different)}; add them to `ignore_modules` to silence this.", UserWarning,
                      stacklevel=3)
    if trainable:
        warnings.warn(f"QuantizedMeBP left {len(trainable)} trainable module(s) uncompressed (their weight has "
                      f"requires_grad=True while other parameters are frozen): {', '.join(trainable)}. Freeze them "
                      "before conversion to compress them.", UserWarning, stacklevel=3)
    return targets


def check_group_sizes(targets: dict[str, nn.Module], group_sizes: dict[str, int]) -> None:
    """Raise on a target whose input features its group size (by name: GGUF blocks keep their own) does not divide."""
    for name, module in targets.items():
        width, group_size = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim, group_sizes[name]
        if width % group_size:
            raise ValueError(f"`group_size={group_size}` does not divide the {width} input features of `{name}` "
                             f"({type(module).__name__}); pick a divisor of {width} or add `{name!r}` to "
                             "`ignore_modules`.")


def install_twin(model: nn.Module, name: str, packed: Packed, fmt: StoredFormat, group_size: int,
                 dtype: torch.dtype) -> nn.Module:
    """Replace target ``name`` of ``model`` by its compressed twin holding ``packed`` (its bias and scale must be
    real tensors); returns the twin."""
    module = model.get_submodule(name)
    if isinstance(module, nn.Embedding):
        scale = getattr(module, "embed_scale", None) if _is_scaled_embedding(module) else None
        new: nn.Module = CompressedEmbedding(packed, fmt, group_size, module.padding_idx, dtype, embed_scale=scale)
    else:
        new = CompressedLinear(module.in_features, module.out_features, packed, module.bias, fmt, group_size)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
    return new


def compress_modules(model: nn.Module, targets: dict[str, nn.Module], fmt: str, group_size: int) -> dict[str, nn.Module]:
    """Replace each target by its compressed twin; tied weights share one compressed copy."""
    stored = get_format(fmt)
    unique = {id(m.weight): m.weight for m in targets.values()}
    devices = {w.device for w in unique.values()}
    # One buffer for all codes and scales (StoredFormat.allocate), on the weights' device.
    shapes = [tuple(w.shape) for w in unique.values()]
    slots = stored.allocate(shapes, group_size, devices.pop()) if len(devices) == 1 else None
    shared = {key: stored.quantize(weight, group_size, out=slots[i] if slots is not None else None)
              for i, (key, weight) in enumerate(unique.items())}
    return {name: install_twin(model, name, shared[id(m.weight)], stored, group_size,
                               m.weight.dtype if m.weight.is_floating_point() else torch.float32)
            for name, m in targets.items()}


def apply_mebp(
    model: nn.Module, config: MeBPConfig | None = None, *, blocks: BlocksSpec = "auto", **options: Any
) -> nn.Module:
    """Convert ``model`` in place to MeBP training form and return it.

    Every ``nn.Linear`` inside the transformer blocks (by ``isinstance``) and, with ``compress_embeddings``,
    the input embedding (Gemma's scaled one included) and LM head (tied or not) become frozen compressed
    layers that decompress their weight only while they run; ``checkpoint`` and ``offload`` are installed
    on the blocks. Never compressed: peft adapters, already quantized layers, subclasses that override
    ``forward`` (warned), ``ignore_modules``, and trainable weights of a model set up for fine-tuning (some
    parameters frozen; warned). A model whose parameters are all trainable (straight from
    ``from_pretrained``) is compressed whole, which freezes it, as ``BitsAndBytesConfig(load_in_4bit=True)``
    does.

    Args:
        model: A Hugging Face causal LM (optionally peft-wrapped), or any module holding one.
        config: The options (:class:`~lcsb_lightning.mebp.MeBPConfig`; its defaults without one).
        blocks: How to find the blocks (see :func:`lcsb_lightning.blocks.find_blocks`).
        **options: :class:`~lcsb_lightning.mebp.MeBPConfig` fields (``fmt="int4"``, ...): without
            ``config`` they build one, beside it they override its fields.

    Raises:
        ValueError: a bad option (see :class:`~lcsb_lightning.mebp.MeBPConfig`), or ``group_size``
            not dividing a layer's inputs.
        ModuleNotFoundError: ``fmt`` needs bitsandbytes and it is missing.
        TypeError: a bad or unknown option, or nothing to convert (raised before the model is changed).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, vocab_size=128)
        >>> model = apply_mebp(LlamaForCausalLM(config), fmt="int4", group_size=32)
        >>> type(model.model.layers[0].mlp.up_proj).__name__
        'CompressedLinear'
    """
    config = build_config(config, options, "apply_mebp")
    if config.map_large_allocations:  # before any step: a heap that already served large blocks keeps serving them
        map_large_allocations()
    if mebp_state(model) is not None:
        raise RuntimeError(f"apply_mebp was already applied to this {type(model).__name__} (or a submodule).")
    found = find_blocks(model, blocks)
    targets = find_targets(model, found, config)
    check_group_sizes(targets, dict.fromkeys(targets, config.group_size))
    if not targets:
        raise TypeError(f"apply_mebp found no `nn.Linear` to compress in the {len(found)} blocks of "
                        f"{type(unwrap_model(model)).__name__} (after `ignore_modules={config.ignore_modules!r}`; "
                        "trainable and already quantized layers are never compressed).")
    compressed = compress_modules(model, targets, config.fmt, config.group_size)
    device = next(iter(compressed.values())).weight.device
    store = MappedWeights(config.offload_dir) if maps_at_conversion(config.weights, device, config.offload_dir) else None
    if store is not None:
        map_compressed(compressed, store)
    return finish_conversion(model, found, compressed, config, store)


def map_compressed(compressed: dict[str, nn.Module], store: MappedWeights) -> None:
    """Move the modules' codes and scales into ``store`` (modules sharing a tensor share its mapping)."""
    mapped: dict[int, Packed] = {}
    for module in compressed.values():
        key = id(module.weight)
        if key not in mapped:
            mapped[key] = store.map(module.packed())  # type: ignore[operator]
        module.weight, module.scales, module.mins = mapped[key].codes, mapped[key].scales, mapped[key].mins


def finish_conversion(model: nn.Module, blocks: list[nn.Module], compressed: dict[str, nn.Module], config: MeBPConfig,
                      weight_store: MappedWeights | None = None, source: str | None = None) -> nn.Module:
    """Install checkpointing/offload on the blocks of an already compressed model and record the state."""
    state = MeBPState(config, blocks, compressed, weight_store=weight_store, source=source)
    state.stats.sync_timing = config.sync_timing
    for module in compressed.values():
        module.stats, module.workspace = state.stats, state.workspace  # type: ignore[union-attr]
        module.weight_store = weight_store  # type: ignore[union-attr]
        module.keep_recomputed_weight = config.keep_recomputed_weights  # type: ignore[union-attr]
    if config.offload == "mmap":
        state.offload = MmapOffload(config.offload_dir)
    if config.checkpoint or state.offload is not None or config.release_heap:
        hooks = state.offload.hooks if state.offload is not None else None
        install_block_wrappers(blocks, config.checkpoint, hooks, state.stats, config.release_heap)
    object.__setattr__(model, STATE_ATTR, state)
    return model


def mebp_state(model: nn.Module) -> MeBPState | None:
    """The :class:`MeBPState` of ``model`` or of a submodule converted by :func:`apply_mebp`, if any."""
    state = getattr(model, STATE_ATTR, None)
    states = (vars(module).get(STATE_ATTR) for module in model.modules())
    return state if state is not None else next((s for s in states if s is not None), None)


def stored_formats(model: nn.Module) -> dict[str, int]:
    """How many compressed weights ``model`` holds in each stored format and group size (tied ones once),
    e.g. ``{"q5_0/32": 168, "q4_k/32": 16}``; empty for a model not converted."""
    state = mebp_state(model)
    weights = {id(m.weight): m for m in state.compressed_modules.values()} if state is not None else {}
    return dict(Counter(f"{m.fmt.name}/{m.group_size}" for m in weights.values()))  # type: ignore[union-attr]
