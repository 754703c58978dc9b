"""A per-instance stack of named ``forward`` wrappers that compose, come off in any order, copy and pickle.

Selective backprop, the frozen prefix and QuantizedMeBP's checkpointing each install a wrapper in the module's
:class:`ForwardStack`. The stack holds no closures, so ``copy.deepcopy`` and ``pickle`` work; wrappers with
``persistent = False`` (owned by one fit) are left out of both.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from torch import nn


class ForwardWrapper(Protocol):
    """What :func:`install_wrapper` accepts."""

    name: str
    persistent: bool

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class ForwardStack:
    """The instance-level ``forward`` of a module: its wrappers (``wrappers[0]`` innermost) around the forward found
    at install time."""

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
        return self.wrappers[index](lambda *a, **k: self._call(index - 1, a, k), *args, **kwargs)

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
    """Add ``wrapper`` as the outermost wrapper of ``module``'s forward (``innermost=True``: the innermost, whatever
    is installed before or later); returns the stack it went into, to remove it with.

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

    When the last wrapper goes and the stack is still the module's forward, the forward found at the first install is
    restored. ``stack`` (the one the wrapper went into) removes it even where a foreign function has replaced the
    module's forward on top of the stack, which then stays a pass-through.
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
