"""Instance-level ``forward`` wrappers that stack and unstack cleanly.

LCSB's identity path and QuantizedMeBP's per-block checkpointing both wrap a block's ``forward`` on
the instance (not the class, so other instances and ``state_dict`` keys are untouched). Each wrapper
records what it wrapped, so that removing it restores exactly the previous forward.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

_INNER = "_wrapped_inner"
_HAD_INSTANCE_FORWARD = "_wrapped_had_instance_forward"


def wrap_forward(
    module: nn.Module, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]], marker: str
) -> None:
    """Replace ``module.forward`` by ``make_wrapper(current_forward)``, tagged with ``marker``."""
    inner: Callable[..., Any] = module.forward  # bound; may itself be an instance-level wrapper
    wrapper = make_wrapper(inner)
    setattr(wrapper, marker, True)
    setattr(wrapper, _INNER, inner)
    setattr(wrapper, _HAD_INSTANCE_FORWARD, "forward" in vars(module))
    module.forward = wrapper  # type: ignore[method-assign]


def has_wrapper(module: nn.Module, marker: str) -> bool:
    """Whether the outermost instance-level forward of ``module`` carries ``marker``."""
    return hasattr(vars(module).get("forward"), marker)


def unwrap_forward(module: nn.Module, marker: str) -> bool:
    """Remove the outermost wrapper if it carries ``marker``; returns whether one was removed."""
    wrapper = vars(module).get("forward")
    if wrapper is None or not hasattr(wrapper, marker):
        return False
    if getattr(wrapper, _HAD_INSTANCE_FORWARD):
        module.forward = getattr(wrapper, _INNER)  # type: ignore[method-assign]
    else:
        del module.forward
    return True
