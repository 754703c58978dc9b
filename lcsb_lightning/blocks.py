"""Discovery of a model's transformer blocks and of the trainable parameters inside them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Union

import torch
from torch import nn

from lcsb_lightning.rank_zero import rank_zero_info

BlocksSpec = Union[str, Callable[[nn.Module], "nn.ModuleList | list[nn.Module]"]]

#: Dotted paths tried in order, relative to the unwrapped model, when no ``nn.ModuleList`` holds the block classes a
#: Hugging Face model declares (``_no_split_modules``): Llama-likes, multimodal Gemma3, GPT-2/Falcon, OPT, GPT-NeoX,
#: bare backbones; a ``decoder`` path brings its ``encoder`` sibling first (``nn.Transformer``).
KNOWN_BLOCK_PATHS: tuple[str, ...] = (
    "model.layers", "model.language_model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers",
    "layers", "h", "decoder.layers", "blocks",
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip wrappers (peft ``PeftModel``/``LoraModel``, DDP, ``torch.compile``) that hide the base model."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, DataParallel
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
    return model


def shared_param_ids(model: nn.Module) -> frozenset[int]:
    """Ids of the parameters ``model`` uses in two places (an input embedding tied to the LM head)."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return frozenset(key for key, count in counts.items() if count > 1)


def _get_dotted(module: nn.Module, path: str) -> object | None:
    obj: object = module
    for part in path.split("."):
        obj = getattr(obj, part, None)  # None stays None
    return obj


def _largest_homogeneous_module_list(model: nn.Module) -> nn.ModuleList | None:
    """Fallback for plain torch models: the longest ``nn.ModuleList`` whose items share one class."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(i) for i in m}) == 1]
    return max(lists, key=len, default=None)


def _candidate_roots(model: nn.Module, max_depth: int = 3) -> list[nn.Module]:
    """``model`` then its submodules breadth-first (each unwrapped): a LightningModule's ``self.model`` is searched."""
    roots, frontier = [model], [model]
    for _ in range(max_depth):
        frontier = [unwrap_model(child) for parent in frontier for child in parent.children()]
        roots.extend(frontier)
    return roots


#: A stack of blocks: its dotted path (relative to the model it was found on) and the list.
Stack = tuple[str, nn.ModuleList]


def _class_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s classes and of the modules that wrappers (``torch.compile``, activation
    checkpointing, FSDP1) hold; FSDP2's ``FSDP<Block>`` subclasses keep the block class in their MRO."""
    names: set[str] = set()
    while module is not None:
        names.update(cls.__name__ for cls in type(module).__mro__)
        module = next(
            (inner for attr in ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
             if isinstance(inner := getattr(module, attr, None), nn.Module)),
            None,
        )
    return names


def _stacks_of_classes(model: nn.Module, class_names: set[str]) -> list[Stack]:
    """The outermost non-empty ``nn.ModuleList``s of ``model`` whose items all are of ``class_names``, in order."""
    stacks: list[Stack] = []
    for path, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) and not any(path.startswith(f"{f}.") for f, _ in stacks)
                and all(_class_names(item) & class_names for item in module)):
            stacks.append((path, module))
    return stacks


def _declared_stacks(model: nn.Module) -> tuple[list[Stack], list[Stack]]:
    """The block stacks a Hugging Face model's class declares (``_no_split_modules``: both stacks of an
    encoder-decoder), and those only its sub-models declare (a vision tower's layers), left outside."""
    for root in _candidate_roots(model):
        declared = getattr(type(root), "_no_split_modules", None)
        if not declared:
            continue
        stacks = _stacks_of_classes(root, set(declared))
        gathered = set(getattr(root, "_no_split_modules", None) or ()) - set(declared)
        found = {id(stack) for _, stack in stacks}
        outside = [s for s in _stacks_of_classes(root, gathered) if id(s[1]) not in found] if gathered else []
        return stacks, outside
    return [], []


def _known_path_stacks(model: nn.Module) -> list[Stack]:
    """The first of :data:`KNOWN_BLOCK_PATHS` found, led by its ``encoder`` sibling where the path is a
    ``decoder``'s (``nn.Transformer``: ``encoder.layers`` then ``decoder.layers``)."""
    for candidate in _candidate_roots(model):
        for path in KNOWN_BLOCK_PATHS:
            found = _get_dotted(candidate, path)
            if isinstance(found, nn.ModuleList) and len(found) > 0:
                parts = path.split(".")
                if len(parts) >= 2 and parts[-2] == "decoder":
                    sibling = ".".join([*parts[:-2], "encoder", parts[-1]])
                    encoder = _get_dotted(candidate, sibling)
                    if isinstance(encoder, nn.ModuleList) and len(encoder) > 0:
                        return [(sibling, encoder), (path, found)]
                return [(path, found)]
    return []


def _describe(stacks: list[Stack]) -> str:
    return ", ".join(f"{path} ({len(stack)} x {type(stack[0]).__name__})" for path, stack in stacks)


def _report(stacks: list[Stack], outside: list[Stack]) -> None:
    """Say which stacks make the block list when it is not one obvious stack."""
    if len(stacks) < 2 and not outside:
        return
    message = (f"LCSB: one list of blocks from {len(stacks)} stacks, in execution order: {_describe(stacks)} "
               "(the backward from the loss reaches the last ones first)" if len(stacks) > 1
               else f"LCSB: blocks {_describe(stacks)}")
    if outside:
        message += f"; left outside the blocks, never selected: {_describe(outside)}"
    rank_zero_info(message + ".")


def find_blocks(model: nn.Module, blocks: BlocksSpec = "auto") -> list[nn.Module]:
    """Return the ordered transformer blocks of ``model``.

    ``"auto"`` prefers the block classes a Hugging Face model declares (``_no_split_modules``), then
    :data:`KNOWN_BLOCK_PATHS`, then the longest ``nn.ModuleList`` of same-class modules; an encoder-decoder's blocks
    come as one list in execution order.

    Args:
        model: A Hugging Face model (optionally wrapped by peft) or a plain torch model.
        blocks: ``"auto"`` to discover, a dotted attribute path (``"model.layers"``) relative to the
            unwrapped model (or, failing that, to ``model`` itself), or a callable ``model -> blocks``.

    Raises:
        ValueError: if no block list can be found.

    Example::

        >>> from torch import nn
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stack = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        >>> len(find_blocks(Net()))
        3
    """
    base = unwrap_model(model)
    if callable(blocks) and not isinstance(blocks, str):
        found = list(blocks(model))
        if not found:
            raise ValueError(f"The `blocks` callable {blocks!r} returned no blocks.")
        return found
    if not isinstance(blocks, str):
        raise TypeError(f"`blocks` must be 'auto', a dotted path or a callable, got {type(blocks).__name__}.")
    if blocks != "auto":
        for root in (base, model):
            found_obj = _get_dotted(root, blocks)
            if isinstance(found_obj, (nn.ModuleList, nn.Sequential, list, tuple)) and len(found_obj) > 0:
                return list(found_obj)
        raise ValueError(f"`blocks={blocks!r}` does not name a non-empty nn.ModuleList on {type(base).__name__}.")
    stacks, outside = _declared_stacks(base)
    if not stacks:
        stacks = _known_path_stacks(base)
    if not stacks:
        fallback = _largest_homogeneous_module_list(base)
        if fallback is None:
            raise ValueError(
                f"Could not find the transformer blocks of {type(base).__name__}: tried the attributes "
                f"{', '.join(KNOWN_BLOCK_PATHS)}, the block classes a Hugging Face model names in "
                "`_no_split_modules` and any nn.ModuleList of same-class modules. Pass "
                "`blocks='dotted.path.to.ModuleList'` or `blocks=lambda model: [...]`."
            )
        stacks = [("", fallback)]
    _report(stacks, outside)
    return [block for _, stack in stacks for block in stack]


@dataclass
class BlockParams:
    """Trainable parameters of a model, grouped by the block that owns them."""

    blocks: list[nn.Module]
    params_per_block: list[list[nn.Parameter]]
    names_per_block: list[list[str]]
    outside: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


def map_trainable_params(model: nn.Module, blocks: BlocksSpec = "auto") -> BlockParams:
    """Group the parameters that currently require grad by block (call it before any ``requires_grad`` toggling).

    Raises:
        ValueError: if no block holds a trainable parameter.
    """
    found = find_blocks(model, blocks)
    names_of = {id(p): n for n, p in model.named_parameters()}
    params_per_block: list[list[nn.Parameter]] = []
    names_per_block: list[list[str]] = []
    in_blocks: set[int] = set()
    for block in found:
        params = [p for p in block.parameters() if p.requires_grad and id(p) not in in_blocks]
        in_blocks.update(id(p) for p in params)
        params_per_block.append(params)
        names_per_block.append([names_of.get(id(p), "?") for p in params])
    if not in_blocks:
        raise ValueError(
            f"No trainable parameter inside any of the {len(found)} blocks of {type(unwrap_model(model)).__name__}: "
            "LCSB selects blocks whose LoRA parameters train. Inject LoRA (e.g. peft.get_peft_model) before fit, "
            "or leave the block parameters with requires_grad=True."
        )
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_blocks]
    return BlockParams(found, params_per_block, names_per_block, outside)


def _reduction_key(grad: torch.Tensor) -> tuple[object, tuple[int, ...]] | None:
    """How a gradient's local squared norm becomes the full one: None for a plain tensor, else its DTensor mesh and
    the mesh dims it is sharded over (summed across; a replicated one needs nothing)."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return None
    if any(placement.is_partial() for placement in placements):
        raise NotImplementedError(
            f"grad_norms: a gradient with placements {tuple(placements)} is a partial sum (unreduced); "
            "FSDP2 gradients are sharded (Shard) or replicated (Replicate)."
        )
    return grad.device_mesh, tuple(dim for dim, placement in enumerate(placements) if placement.is_shard())


def block_grad_norms(params_per_block: list[list[torch.Tensor]]) -> torch.Tensor:
    """The L2 norm of each block's gradients (0 for a block without any), as one float32 tensor without a read-back;
    sharded DTensor gradients (FSDP2) take one ``all_reduce`` per mesh and sharded dim for all blocks together."""
    grads = [[p.grad.detach() for p in params if p.grad is not None] for params in params_per_block]
    flat = [g for block in grads for g in block]
    if not flat:
        return torch.zeros(len(params_per_block))
    device = getattr(flat[0], "to_local", lambda: flat[0])().device
    # Per reduction key: the local squared norm of each block's gradients of that key.
    squares: dict[tuple[object, tuple[int, ...]] | None, torch.Tensor] = {}
    for index, block in enumerate(grads):
        by_key: dict[tuple[object, tuple[int, ...]] | None, list[torch.Tensor]] = {}
        for grad in block:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            by_key.setdefault(_reduction_key(grad), []).append(local)
        for key, tensors in by_key.items():
            if key not in squares:
                squares[key] = torch.zeros(len(grads), dtype=torch.float32, device=device)
            norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
            squares[key][index] = norm.to(device=device, dtype=torch.float32).square()
    total = torch.zeros(len(grads), dtype=torch.float32, device=device)
    for key, square in squares.items():
        if key is not None:
            mesh, shard_dims = key
            for dim in shard_dims:
                torch.distributed.all_reduce(square, group=mesh.get_group(dim))  # type: ignore[attr-defined]
        total += square
    return total.sqrt()


def grad_norms(params_per_block: list[list[torch.Tensor]]) -> list[float]:
    """:func:`block_grad_norms`, read back once."""
    return block_grad_norms(params_per_block).tolist()
