"""A per-instance stack of named ``forward`` wrappers that compose, come off in any order, copy and pickle.

LCSB's selective backprop and QuantizedMeBP's per-block checkpointing both change how a transformer
block runs its forward. Each installs a *forward wrapper*: an object with a ``name`` and a
``__call__(inner, *args, **kwargs)`` that decides how (or whether) to call ``inner``, the forward
below it. All wrappers of a module live in one :class:`ForwardStack` stored as the instance's
``forward``; the class's own forward (or whatever instance-level forward was there before) sits at
the bottom. Wrappers can be installed and removed in any order; removing the last one restores exactly
the forward that was there before.

The stack is a plain object (no closures), so ``copy.deepcopy`` gives a copy whose wrappers act on the
copy, and ``pickle``/``torch.save(model)`` work. Wrappers marked ``persistent = False`` (LCSB's, owned
by one running fit) are left out of copies and pickles: a copy of a model that is being trained with
LCSB is an ordinary model.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from torch import nn


class ForwardWrapper(Protocol):
    """What :func:`install_wrapper` accepts."""

    name: str
    persistent: bool

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class _Inner:
    """``inner`` for wrapper ``index`` of a stack: calls the wrapper below it, or the base forward."""

    __slots__ = ("stack", "index")

    def __init__(self, stack: ForwardStack, index: int) -> None:
        self.stack, self.index = stack, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.stack._call(self.index, args, kwargs)


class ForwardStack:
    """The instance-level ``forward`` of a module: its wrappers around the forward found at install time.

    Wrappers run outermost first; ``wrappers[0]`` is the innermost.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # An instance-level forward installed by someone else before us stays at the bottom.
        self.base: Callable[..., Any] | None = vars(module).get("forward")
        self.wrappers: list[ForwardWrapper] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(len(self.wrappers) - 1, args, kwargs)

    def _call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index < 0:
            if self.base is not None:
                return self.base(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.wrappers[index](_Inner(self, index - 1), *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "base": self.base, "wrappers": [w for w in self.wrappers if w.persistent]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ForwardStack({type(self.module).__name__}, wrappers={[wrapper.name for wrapper in self.wrappers]})"


def forward_stack(module: nn.Module) -> ForwardStack | None:
    """The module's :class:`ForwardStack`, if its instance-level forward is one."""
    found = vars(module).get("forward")
    return found if isinstance(found, ForwardStack) else None


def install_wrapper(module: nn.Module, wrapper: ForwardWrapper, innermost: bool = False) -> ForwardStack:
    """Add ``wrapper`` as the outermost wrapper of ``module``'s forward (``innermost=True``: the innermost,
    right above the forward found at install time, whatever was installed before or is installed later).

    Returns the stack the wrapper went into (keep it to remove the wrapper later).

    Raises:
        RuntimeError: ``module`` already has a wrapper of that name.

    Example::

        >>> import torch
        >>> class Double:
        ...     name, persistent = "double", True
        ...     def __call__(self, inner, *args, **kwargs):
        ...         return 2 * inner(*args, **kwargs)
        >>> linear = nn.Linear(2, 2)
        >>> x = torch.ones(1, 2)
        >>> _ = install_wrapper(linear, Double())
        >>> bool(torch.equal(linear(x), 2 * type(linear).forward(linear, x)))
        True
        >>> remove_wrapper(linear, "double"), "forward" in vars(linear)
        (True, False)
    """
    stack = forward_stack(module)
    if stack is None:
        stack = ForwardStack(module)
        module.forward = stack  # type: ignore[method-assign]
    if any(existing.name == wrapper.name for existing in stack.wrappers):
        raise RuntimeError(f"{type(module).__name__} already has the forward wrapper {wrapper.name!r} installed.")
    if innermost:
        stack.wrappers.insert(0, wrapper)
    else:
        stack.wrappers.append(wrapper)
    return stack


def get_wrapper(module: nn.Module, name: str) -> ForwardWrapper | None:
    """The installed wrapper called ``name``, or ``None``."""
    stack = forward_stack(module)
    return next((wrapper for wrapper in stack.wrappers if wrapper.name == name), None) if stack is not None else None


def remove_wrapper(module: nn.Module, name: str, stack: ForwardStack | None = None) -> bool:
    """Remove the wrapper called ``name`` wherever it sits; returns whether one was removed.

    When the last wrapper goes and the stack is still the module's forward, the forward that was there
    before the first install is restored exactly. ``stack`` is the stack the wrapper was installed in
    (remembered by its owner): it lets a wrapper be removed even after a foreign function has replaced
    the module's forward on top of the stack, which then keeps working as a pass-through.
    """
    stack = stack if stack is not None else forward_stack(module)
    if stack is None:
        return False
    kept = [wrapper for wrapper in stack.wrappers if wrapper.name != name]
    if len(kept) == len(stack.wrappers):
        return False
    stack.wrappers = kept
    if not kept and vars(module).get("forward") is stack:
        if stack.base is not None:
            module.forward = stack.base  # type: ignore[method-assign]
        else:
            del module.forward
    return True
