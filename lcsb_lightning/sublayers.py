"""Plain-torch core of sublayer drop (DropBP, arXiv 2402.17812): a block's attention and MLP sublayers leave the
backward independently.

A pre-norm transformer block adds each sublayer's output to the residual stream: ``h = x + attn(norm(x))``,
``out = h + mlp(norm(h))``. A *dropped* sublayer runs its forward under ``no_grad`` and adds an output that
carries no gradient back into it, so the incoming gradient reaches the block's input through the residual
alone (DropBP's detach), nothing of the sublayer is stored for backward, and its trainable parameters receive
an exact zero gradient (LCSB's implicit update, and every parameter gets a gradient at every step: plain
DDP works). Kept sublayers back-propagate exactly as usual.

Units are numbered ``2 * block`` (attention) and ``2 * block + 1`` (MLP), bottom to top.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lcsb_lightning.blocks import BlockParams
from lcsb_lightning.forward_wrap import ForwardStack, install_wrapper, remove_wrapper
from lcsb_lightning.hidden_states import replace_hidden
from lcsb_lightning.selective import IdentityPath

#: Name of the sublayer-drop wrapper in a sublayer's forward stack.
SUBLAYER_WRAPPER = "lcsb_sublayer_drop"
#: Child names of a block's attention and MLP sublayers (Llama, Qwen2, Gemma, Mistral, GPT-2, Falcon, ...).
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")


def find_sublayers(block: nn.Module, index: int = 0) -> tuple[nn.Module, nn.Module]:
    """The attention and MLP children of a transformer ``block``.

    Raises:
        ValueError: naming the block's children when either is missing.
    """
    children = dict(block.named_children())
    attention = next((children[n] for n in ATTENTION_NAMES if n in children), None)
    mlp = next((children[n] for n in MLP_NAMES if n in children), None)
    if attention is None or mlp is None:
        raise ValueError(
            f"Sublayer drop needs an attention child ({', '.join(ATTENTION_NAMES)}) and an MLP child "
            f"({', '.join(MLP_NAMES)}) in every block; block {index} ({type(block).__name__}) has "
            f"{', '.join(children) or 'no children'}. Use a block policy (e.g. policy='dyadic')."
        )
    return attention, mlp


def sublayer_params(block_params: BlockParams) -> BlockParams:
    """``block_params`` split into units: each block's attention, then its MLP.

    Raises:
        ValueError: if a block holds trainable parameters outside its two sublayers (a trainable norm),
            which no sublayer owns.
    """
    units: list[nn.Module] = []
    params_per_unit: list[list[nn.Parameter]] = []
    names_per_unit: list[list[str]] = []
    for index, (block, params, names) in enumerate(
        zip(block_params.blocks, block_params.params_per_block, block_params.names_per_block)
    ):
        name_of = {id(p): n for p, n in zip(params, names)}
        claimed: set[int] = set()
        for sublayer in find_sublayers(block, index):
            owned = [p for p in sublayer.parameters() if id(p) in name_of and id(p) not in claimed]
            claimed.update(id(p) for p in owned)
            units.append(sublayer)
            params_per_unit.append(owned)
            names_per_unit.append([name_of[id(p)] for p in owned])
        stray = [name_of[id(p)] for p in params if id(p) not in claimed]
        if stray:
            raise ValueError(
                f"Sublayer drop gives every trainable parameter to an attention or MLP sublayer; block {index} "
                f"trains {len(stray)} outside them (e.g. {', '.join(stray[:3])}). Use a block policy, or "
                "leave those parameters frozen."
            )
    return BlockParams(units, params_per_unit, names_per_unit, block_params.outside)


def sublayer_flops(sublayer: nn.Module, seq_len: int, attention: bool) -> float:
    """Forward multiply-adds per token of ``sublayer``: its linear layers' ``in x out`` (frozen and LoRA
    alike), plus ``2 * seq_len * width`` for an attention's scores and weighted sum. Only the ratios between
    units matter (DropBP weighs its drop-rate budget with them)."""
    total, width = 0.0, 0
    for module in sublayer.modules():
        if any(True for _ in module.children()):
            continue  # count leaves only: a peft LoRA layer's base and adapters are its children
        in_features = getattr(module, "in_features", getattr(module, "nx", None))  # nx, nf: GPT-2's Conv1D
        out_features = getattr(module, "out_features", getattr(module, "nf", None))
        if isinstance(in_features, int) and isinstance(out_features, int):
            total += in_features * out_features
            width = max(width, in_features)
    return total + (2.0 * seq_len * width if attention else 0.0)


class SublayerDropForward:
    """The wrapper on one sublayer: runs it as usual when kept, cut from the backward when dropped."""

    name = SUBLAYER_WRAPPER
    persistent = False  # owned by one fit: copies and pickles of the model leave it out

    def __init__(self, params: Sequence[nn.Parameter] = ()) -> None:
        self.params = list(params)
        self.dropped = False

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not self.dropped or not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        with torch.no_grad():
            output = inner(*args, **kwargs)
        trainable = [p for p in self.params if p.requires_grad]
        if not trainable:
            return output
        # value: the sublayer's output; backward: nothing into the sublayer, exact zeros to its parameters
        return replace_hidden(output, lambda hidden: IdentityPath.apply(hidden, hidden, *trainable))

    def __repr__(self) -> str:
        return f"SublayerDropForward(dropped={self.dropped}, params={len(self.params)})"


class SublayerDrop:
    """Installs :class:`SublayerDropForward` on a list of sublayers and switches which ones are kept.

    It has :class:`~lcsb_lightning.selective.SelectiveBackprop`'s interface (``set_selection``, ``clear``,
    ``remove``), with units in place of blocks.

    Example::

        >>> blocks = [nn.ModuleDict({"attn": nn.Linear(4, 4), "mlp": nn.Linear(4, 4)}) for _ in range(2)]
        >>> units = [m for b in blocks for m in (b["attn"], b["mlp"])]
        >>> drop = SublayerDrop(units, [list(u.parameters()) for u in units])
        >>> drop.set_selection([1, 2])  # drop block 0's attention and block 1's MLP
        >>> h = torch.randn(2, 4)
        >>> for b in blocks:
        ...     h = h + b["attn"](h)
        ...     h = h + b["mlp"](h)
        >>> h.sum().backward()
        >>> [float(u.weight.grad.abs().sum()) > 0 for u in units]
        [False, True, True, False]
        >>> drop.remove()
    """

    def __init__(self, units: Sequence[nn.Module], params_per_unit: Sequence[Sequence[nn.Parameter]]) -> None:
        if len(params_per_unit) != len(units):
            raise ValueError(f"{len(params_per_unit)} parameter lists for {len(units)} sublayers.")
        self.units = list(units)
        self.selected: tuple[int, ...] | None = None  # None: every sublayer is kept
        self.wrappers: list[SublayerDropForward] = []
        self._stacks: list[ForwardStack] = []
        try:
            for unit, params in zip(self.units, params_per_unit):
                wrapper = SublayerDropForward(params)
                self._stacks.append(install_wrapper(unit, wrapper))
                self.wrappers.append(wrapper)
        except BaseException:
            self.remove()
            raise

    def set_selection(self, selected: Iterable[int]) -> None:
        """Keep the ``selected`` units in the backward; drop the others."""
        chosen = set(selected)
        self.selected = tuple(sorted(chosen))
        for index, wrapper in enumerate(self.wrappers):
            wrapper.dropped = index not in chosen

    #: The gradient reaches whatever lies below the first block through the residual stream at every step.
    reaches_below = True
    params_below: list[torch.Tensor] = []

    def clear(self) -> None:
        """Keep every sublayer (as if nothing were installed)."""
        for wrapper in self.wrappers:
            wrapper.dropped = False
        self.selected = None

    def remove(self) -> None:
        """Remove the wrappers; each sublayer's forward is exactly what it was before (idempotent)."""
        for unit, stack in zip(self.units, self._stacks):
            remove_wrapper(unit, SUBLAYER_WRAPPER, stack)
        self.wrappers, self._stacks = [], []


def measure_sensitivity(
    loss_fn: Callable[[], torch.Tensor], drop: SublayerDrop, params_per_unit: Sequence[Sequence[nn.Parameter]]
) -> list[float]:
    """DropBP's sensitivity of each unit: ``sum over parameters of (|g| - |g_without_unit|)^2``, where ``g`` is
    the exact gradient of ``loss_fn()`` and ``g_without_unit`` its gradient with only that unit dropped (one
    forward and backward per unit, plus one). Every pass sees the same random draws (dropout), as DropBP seeds
    each alike, so that a sensitivity is what the unit's drop changes and not the noise between two masks; the
    caller's random streams (CPU and CUDA), ``.grad`` and the selection are left as they were."""
    flat = [p for params in params_per_unit for p in params if p.requires_grad]
    if not flat:
        return [0.0] * len(params_per_unit)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []

    def norms(dropped: int | None) -> torch.Tensor:
        torch.set_rng_state(cpu_state)
        for device, state in zip(devices, cuda_states):
            torch.cuda.set_rng_state(state, device)
        drop.set_selection(i for i in range(len(params_per_unit)) if i != dropped)
        with torch.enable_grad():
            grads = torch.autograd.grad(loss_fn(), flat, allow_unused=True)
        return torch.stack([torch.zeros(()) if g is None else g.detach().float().norm().cpu() for g in grads])

    previous = drop.selected
    with torch.random.fork_rng(devices=devices):
        cpu_state, cuda_states = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
        try:
            reference = norms(None)
            return [float(((reference - norms(unit)) ** 2).sum()) for unit in range(len(params_per_unit))]
        finally:
            if previous is None:
                drop.clear()
            else:
                drop.set_selection(previous)


def first_example(batch: Any) -> Any:
    """``batch`` cut to its first example: every tensor that has the batch's leading size keeps one row
    (dicts, lists and tuples are walked; anything else is kept as it is)."""
    sizes = [t.shape[0] for t in _tensors(batch) if t.dim() >= 1]
    if not sizes:
        return batch
    size = sizes[0]

    def cut(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item[:1] if item.dim() >= 1 and item.shape[0] == size else item
        if isinstance(item, dict):
            return type(item)((k, cut(v)) for k, v in item.items())
        if isinstance(item, (list, tuple)):
            return type(item)(cut(v) for v in item)
        return item

    return cut(batch)


def sequence_length(batch: Any) -> int:
    """The length of the first 2-d (or wider) tensor of ``batch``: its token sequences (1 if none)."""
    return next((int(t.shape[1]) for t in _tensors(batch) if t.dim() >= 2), 1)


def _tensors(item: Any) -> list[torch.Tensor]:
    if isinstance(item, torch.Tensor):
        return [item]
    if isinstance(item, dict):
        return [t for v in item.values() for t in _tensors(v)]
    if isinstance(item, (list, tuple)):
        return [t for v in item for t in _tensors(v)]
    return []
