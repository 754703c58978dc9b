"""``apply_mebp``: compress a model's frozen Linears (and embeddings), install checkpointing/offload."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from lcsb_lightning.blocks import BlocksSpec, find_blocks, unwrap_model
from lcsb_lightning.mebp._internal.checkpoint import install_block_wrappers
from lcsb_lightning.mebp._internal.formats import Packed, allocate_packed, quantize, validate_format
from lcsb_lightning.mebp.compressed import CompressedEmbedding, CompressedLinear
from lcsb_lightning.mebp._internal.offload import MmapOffload
from lcsb_lightning.mebp._internal.stats import MeBPStats
from lcsb_lightning.mebp._internal.storage import MappedWeights, mmap_supported
from lcsb_lightning.mebp._internal.workspace import DecompressionWorkspace

OFFLOAD_MODES: tuple[str, ...] = ("none", "mmap")
#: Where the compressed weights live: process memory, or memory-mapped files released after each use.
WEIGHT_STORAGE: tuple[str, ...] = ("ram", "mmap")
#: Attribute under which ``apply_mebp`` records what it did on the model.
STATE_ATTR = "_mebp_state"


@dataclass
class MeBPState:
    """What :func:`apply_mebp` installed on a model (``model._mebp_state``)."""

    fmt: str
    group_size: int
    blocks: list[nn.Module]
    layers: dict[str, nn.Module] = field(default_factory=dict)
    offload: MmapOffload | None = None
    weight_store: MappedWeights | None = None
    stats: MeBPStats = field(default_factory=MeBPStats)
    workspace: DecompressionWorkspace = field(default_factory=DecompressionWorkspace)

    def close(self) -> None:
        """Remove the offload and weight directories (the compressed layers stay usable)."""
        if self.offload is not None:
            self.offload.close()
        if self.weight_store is not None:
            self.weight_store.close()


def validate_args(
    fmt: str,
    group_size: int,
    checkpoint: bool,
    offload: str,
    ignore_modules: Iterable[str],
    weights: str = "ram",
    keep_recomputed_weights: bool = True,
    release_heap: bool = True,
) -> None:
    """Check every argument of :func:`apply_mebp` / ``QuantizedMeBP`` (raises before any work)."""
    validate_format(fmt, group_size)
    if not isinstance(checkpoint, bool):
        raise TypeError(f"`checkpoint` must be a bool, got {checkpoint!r}.")
    for name, flag in (("keep_recomputed_weights", keep_recomputed_weights), ("release_heap", release_heap)):
        if not isinstance(flag, bool):
            raise TypeError(f"`{name}` must be a bool, got {flag!r}.")
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"`offload={offload!r}` is not supported; choose one of {', '.join(map(repr, OFFLOAD_MODES))}.")
    if weights not in WEIGHT_STORAGE:
        raise ValueError(f"`weights={weights!r}` is not supported; choose one of {', '.join(map(repr, WEIGHT_STORAGE))}.")
    if weights == "mmap" and not mmap_supported():
        raise ValueError("`weights='mmap'` needs madvise (Linux or macOS); use `weights='ram'` here.")
    if isinstance(ignore_modules, str) or not all(isinstance(name, str) for name in ignore_modules):
        raise TypeError(f"`ignore_modules` must be a collection of module names, got {ignore_modules!r}.")


def _ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    dotted = f".{name}."
    return any(f".{ignored}." in dotted for ignored in ignore_modules)


def _adapter_module_ids(model: nn.Module) -> set[int]:
    """Modules inside peft adapter containers (LoRA A/B): never compressed."""
    excluded: set[int] = set()
    for module in model.modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            container = getattr(module, attr, None)
            if isinstance(container, nn.Module):
                excluded.update(id(m) for m in container.modules())
    return excluded


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
    return isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding") and hasattr(
        module, "embed_scale"
    )


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


def find_targets(
    model: nn.Module, blocks: list[nn.Module], compress_embeddings: bool, ignore_modules: Iterable[str], group_size: int
) -> dict[str, nn.Module]:
    """Qualified names of the modules to compress; raises on a ``group_size`` that does not fit one.

    A candidate (any ``nn.Linear`` in a block, subclasses included; with ``compress_embeddings`` the
    input embedding and LM head) is compressed unless it is a peft adapter (LoRA A/B), already
    quantized (a non-float weight: bitsandbytes' ``Linear4bit``, a ``CompressedLinear``), a subclass
    whose ``forward`` computes something else (warned), named in ``ignore_modules``, or trainable in
    a model set up for fine-tuning (see :func:`apply_mebp`; warned).
    """
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    excluded = _adapter_module_ids(model)
    # A model whose parameters are all trainable has not been set up for fine-tuning yet (it comes
    # straight from from_pretrained): compressing freezes it. Otherwise requires_grad is the user's choice.
    set_up = any(not p.requires_grad for p in model.parameters() if p.is_floating_point())  # not quantized ones
    targets: dict[str, nn.Module] = {}
    trainable: list[str] = []
    different: list[str] = []
    for module in _candidates(model, blocks, compress_embeddings):
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
        warnings.warn(
            f"QuantizedMeBP left {len(different)} module(s) uncompressed whose class overrides `forward`: "
            f"{', '.join(different)}; add them to `ignore_modules` to silence this.",
            UserWarning,
            stacklevel=3,
        )
    if trainable:
        warnings.warn(
            f"QuantizedMeBP left {len(trainable)} trainable module(s) uncompressed (their weight has "
            f"requires_grad=True while other parameters are frozen): {', '.join(trainable)}. Freeze them "
            "before conversion to compress them.",
            UserWarning,
            stacklevel=3,
        )
    for name, module in targets.items():
        width = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        if width % group_size:
            raise ValueError(
                f"`group_size={group_size}` does not divide the {width} input features of `{name}` "
                f"({type(module).__name__}); pick a divisor of {width} or add `{name!r}` to `ignore_modules`."
            )
    return targets


def compressed_twin(module: nn.Module, packed: Packed, fmt: str, group_size: int, dtype: torch.dtype) -> nn.Module:
    """The compressed replacement of a target ``module`` holding ``packed`` (its bias and embedding
    scale, if any, must already be real tensors)."""
    if isinstance(module, nn.Embedding):
        scale = getattr(module, "embed_scale", None) if _is_scaled_embedding(module) else None
        return CompressedEmbedding(packed, fmt, group_size, module.padding_idx, dtype, embed_scale=scale)
    return CompressedLinear(module.in_features, module.out_features, packed, module.bias, fmt, group_size)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def compress_modules(model: nn.Module, targets: dict[str, nn.Module], fmt: str, group_size: int) -> dict[str, nn.Module]:
    """Replace each target by its compressed twin; tied weights share one compressed copy."""
    unique = {id(m.weight): m.weight for m in targets.values()}
    devices = {w.device for w in unique.values()}
    # One buffer for all codes and one for all scales (see allocate_packed), on the weights' device.
    shapes = [tuple(w.shape) for w in unique.values()]
    slots = allocate_packed(shapes, group_size, devices.pop()) if len(devices) == 1 else None
    shared = {
        key: quantize(weight, fmt, group_size, out=slots[i] if slots is not None else None)
        for i, (key, weight) in enumerate(unique.items())
    }
    done: dict[str, nn.Module] = {}
    for name, module in targets.items():
        key = id(module.weight)
        dtype = module.weight.dtype if module.weight.is_floating_point() else torch.float32
        new = compressed_twin(module, shared[key], fmt, group_size, dtype)
        _set_module(model, name, new)
        done[name] = new
    return done


def apply_mebp(
    model: nn.Module,
    fmt: str = "nf4",
    group_size: int = 64,
    checkpoint: bool = True,
    offload: str = "none",
    compress_embeddings: bool = True,
    ignore_modules: Iterable[str] = (),
    *,
    weights: str = "ram",
    keep_recomputed_weights: bool = True,
    release_heap: bool = True,
    blocks: BlocksSpec = "auto",
    offload_dir: str | None = None,
) -> nn.Module:
    """Convert ``model`` in place to MeBP training form and return it.

    Every ``nn.Linear`` inside the transformer blocks (found by ``isinstance``) and, with
    ``compress_embeddings``, the input embedding (Gemma's scaled one included) and LM head (tied or
    not) become 4-bit frozen layers that decompress their weight only while they run. With
    ``checkpoint`` each block is recomputed in backward; ``offload="mmap"`` writes the blocks' saved
    tensors to memory-mapped files.

    Never compressed: peft adapters (LoRA A/B), already quantized layers (bitsandbytes'
    ``Linear4bit``), subclasses that override ``forward`` (warned) and **trainable weights**: in a model
    set up for fine-tuning (some parameters frozen, as after ``get_peft_model``) a Linear whose weight
    has ``requires_grad=True`` stays as it is and trainable (warned once, with the names). A model
    whose parameters are all trainable (straight from ``from_pretrained``) is not set up yet: all of
    its candidates are compressed, which freezes them, as ``BitsAndBytesConfig(load_in_4bit=True)``
    does.

    Args:
        model: A Hugging Face causal LM (optionally peft-wrapped), or any module holding one.
        fmt: ``"int4"`` (plain torch), ``"nf4"`` or ``"fp4"`` (bitsandbytes).
        group_size: Weights per scale; must divide every converted layer's input features.
        checkpoint: Per-block non-reentrant gradient checkpointing.
        offload: ``"none"`` or ``"mmap"``.
        compress_embeddings: Also compress the input embedding and LM head.
        ignore_modules: Modules to keep as is, each matched as whole dotted parts of the qualified
            name: ``"lm_head"``, ``"down_proj"`` or ``"model.layers.0"`` (everything under it).
        weights: ``"ram"`` keeps the compressed weights in process memory; ``"mmap"`` writes them to
            memory-mapped files and drops each layer's pages from the process after it ran
            (:mod:`~lcsb_lightning.mebp._internal.storage`; CPU, Linux/macOS).
        keep_recomputed_weights: With ``checkpoint``, keep each Linear's weight decompressed by the
            backward recompute until that Linear's backward (one backward decompression per layer).
            ``False`` decompresses it again there instead: the same gradients, bit for bit, with at
            most one layer's float weight alive at a time, for one more decompression per layer.
        release_heap: On CPU, return freed heap memory to the OS before each block runs and before
            its recompute (glibc ``malloc_trim``; :mod:`~lcsb_lightning.mebp._internal.heap`): the resident set
            stays flat instead of growing from step to step, for a few percent of step time.
        blocks: How to find the blocks (see :func:`lcsb_lightning.blocks.find_blocks`).
        offload_dir: Parent of the temporary offload and weight directories.

    Raises:
        ValueError: unknown ``fmt``/``offload``, or ``group_size`` not dividing a layer's inputs.
        ModuleNotFoundError: ``fmt`` needs bitsandbytes and it is missing.
        TypeError: nothing to convert (raised before the model is changed).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, vocab_size=128)
        >>> model = apply_mebp(LlamaForCausalLM(config), fmt="int4", group_size=32)
        >>> type(model.model.layers[0].mlp.up_proj).__name__
        'CompressedLinear'
    """
    validate_args(fmt, group_size, checkpoint, offload, ignore_modules, weights, keep_recomputed_weights, release_heap)
    if mebp_state(model) is not None:
        raise RuntimeError(f"apply_mebp was already applied to this {type(model).__name__} (or a submodule).")
    found = find_blocks(model, blocks)
    targets = find_targets(model, found, compress_embeddings, tuple(ignore_modules), group_size)
    if not targets:
        raise TypeError(
            f"apply_mebp found no `nn.Linear` to compress in the {len(found)} blocks of "
            f"{type(unwrap_model(model)).__name__} (after `ignore_modules={tuple(ignore_modules)!r}`; "
            "trainable and already quantized layers are never compressed)."
        )
    layers = compress_modules(model, targets, fmt, group_size)
    store = MappedWeights(offload_dir) if weights == "mmap" else None
    if store is not None:
        map_layers(layers, store)
    return finish_conversion(
        model, found, layers, fmt, group_size, checkpoint, offload, offload_dir, store, keep_recomputed_weights,
        release_heap,
    )


def map_layers(layers: dict[str, nn.Module], store: MappedWeights) -> None:
    """Move the layers' codes and scales into ``store`` (layers sharing a tensor share its mapping)."""
    mapped: dict[int, Packed] = {}
    for layer in layers.values():
        key = id(layer.weight)
        if key not in mapped:
            mapped[key] = store.map(layer.packed())  # type: ignore[operator]
        layer.weight, layer.scales = mapped[key].codes, mapped[key].scales


def finish_conversion(
    model: nn.Module,
    blocks: list[nn.Module],
    layers: dict[str, nn.Module],
    fmt: str,
    group_size: int,
    checkpoint: bool,
    offload: str,
    offload_dir: str | None,
    weight_store: MappedWeights | None = None,
    keep_recomputed_weights: bool = True,
    release_heap: bool = True,
) -> nn.Module:
    """Install checkpointing/offload on the blocks of an already compressed model and record the state."""
    state = MeBPState(fmt, group_size, blocks, layers, weight_store=weight_store)
    for layer in layers.values():
        layer.stats, layer.workspace = state.stats, state.workspace  # type: ignore[union-attr]
        layer.weight_store = weight_store  # type: ignore[union-attr]
        layer.keep_recomputed_weight = keep_recomputed_weights  # type: ignore[union-attr]
    if offload == "mmap":
        state.offload = MmapOffload(offload_dir)
    if checkpoint or state.offload is not None or release_heap:
        hooks = state.offload.hooks if state.offload is not None else None
        install_block_wrappers(blocks, checkpoint, hooks, state.stats, release_heap)
    object.__setattr__(model, STATE_ATTR, state)
    return model


def mebp_state(model: nn.Module) -> MeBPState | None:
    """The :class:`MeBPState` of ``model`` or of a submodule converted by :func:`apply_mebp`, if any."""
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        return state
    for module in model.modules():
        state = vars(module).get(STATE_ATTR)
        if state is not None:
            return state
    return None
