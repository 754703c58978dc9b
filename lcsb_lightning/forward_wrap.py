"""A per-instance stack of named ``forward`` layers that compose, come off in any order, copy and pickle.

LCSB's selective backprop and QuantizedMeBP's per-block checkpointing both change how a transformer
block runs its forward. Each installs a *layer*: an object with a ``name`` and a
``__call__(inner, *args, **kwargs)`` that decides how (or whether) to call ``inner``, the forward
below it. All layers of a module live in one :class:`ForwardStack` stored as the instance's
``forward``; the class's own forward (or whatever instance-level forward was there before) sits at
the bottom. Layers can be installed and removed in any order; removing the last one restores exactly
the forward that was there before.

The stack is a plain object (no closures), so ``copy.deepcopy`` gives a copy whose layers act on the
copy, and ``pickle``/``torch.save(model)`` work. Layers marked ``persistent = False`` (LCSB's, owned
by one running fit) are left out of copies and pickles: a copy of a model that is being trained with
LCSB is an ordinary model.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from torch import nn


class ForwardLayer(Protocol):
    """What :func:`install_layer` accepts."""

    name: str
    persistent: bool

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class _Inner:
    """``inner`` for layer ``index`` of a stack: calls the layer below it, or the base forward."""

    __slots__ = ("stack", "index")

    def __init__(self, stack: ForwardStack, index: int) -> None:
        self.stack, self.index = stack, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.stack._call(self.index, args, kwargs)


class ForwardStack:
    """The instance-level ``forward`` of a module: its layers around the forward found at install time.

    Layers run outermost first; ``layers[0]`` is the innermost.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # An instance-level forward installed by someone else before us stays at the bottom.
        self.base: Callable[..., Any] | None = vars(module).get("forward")
        self.layers: list[ForwardLayer] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(len(self.layers) - 1, args, kwargs)

    def _call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index < 0:
            if self.base is not None:
                return self.base(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.layers[index](_Inner(self, index - 1), *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "base": self.base, "layers": [layer for layer in self.layers if layer.persistent]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ForwardStack({type(self.module).__name__}, layers={[layer.name for layer in self.layers]})"


def forward_stack(module: nn.Module) -> ForwardStack | None:
    """The module's :class:`ForwardStack`, if its instance-level forward is one."""
    found = vars(module).get("forward")
    return found if isinstance(found, ForwardStack) else None


def install_layer(module: nn.Module, layer: ForwardLayer) -> ForwardStack:
    """Add ``layer`` as the outermost layer of ``module``'s forward.

    Returns the stack the layer went into (keep it to remove the layer later).

    Raises:
        RuntimeError: ``module`` already has a layer of that name.

    Example::

        >>> import torch
        >>> class Double:
        ...     name, persistent = "double", True
        ...     def __call__(self, inner, *args, **kwargs):
        ...         return 2 * inner(*args, **kwargs)
        >>> linear = nn.Linear(2, 2)
        >>> x = torch.ones(1, 2)
        >>> _ = install_layer(linear, Double())
        >>> bool(torch.equal(linear(x), 2 * type(linear).forward(linear, x)))
        True
        >>> remove_layer(linear, "double"), "forward" in vars(linear)
        (True, False)
    """
    stack = forward_stack(module)
    if stack is None:
        stack = ForwardStack(module)
        module.forward = stack  # type: ignore[method-assign]
    if any(existing.name == layer.name for existing in stack.layers):
        raise RuntimeError(f"{type(module).__name__} already has the forward layer {layer.name!r} installed.")
    stack.layers.append(layer)
    return stack


def get_layer(module: nn.Module, name: str) -> ForwardLayer | None:
    """The installed layer called ``name``, or ``None``."""
    stack = forward_stack(module)
    return next((layer for layer in stack.layers if layer.name == name), None) if stack is not None else None


def remove_layer(module: nn.Module, name: str, stack: ForwardStack | None = None) -> bool:
    """Remove the layer called ``name`` wherever it sits; returns whether one was removed.

    When the last layer goes and the stack is still the module's forward, the forward that was there
    before the first install is restored exactly. ``stack`` is the stack the layer was installed in
    (remembered by its owner): it lets a layer be removed even after a foreign wrapper has replaced
    the module's forward on top of the stack, which then keeps working as a pass-through.
    """
    stack = stack if stack is not None else forward_stack(module)
    if stack is None:
        return False
    kept = [layer for layer in stack.layers if layer.name != name]
    if len(kept) == len(stack.layers):
        return False
    stack.layers = kept
    if not kept and vars(module).get("forward") is stack:
        if stack.base is not None:
            module.forward = stack.base  # type: ignore[method-assign]
        else:
            del module.forward
    return True
