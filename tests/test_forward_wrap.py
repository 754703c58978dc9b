"""The forward-wrapper stack: any install and removal order, foreign wrappers, deepcopy and pickle."""

from __future__ import annotations

import copy
import io
import itertools
import pickle
from typing import Any, Callable

import pytest
import torch
from torch import nn

from lcsb_lightning.forward_wrap import forward_stack, get_wrapper, install_wrapper, remove_wrapper


class AddWrapper:
    """Adds a constant to the output of the forward below it."""

    def __init__(self, name: str, value: float, persistent: bool = True) -> None:
        self.name, self.value, self.persistent = name, value, persistent

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs) + self.value


class ScaleWrapper:
    name, persistent = "scale", True

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs) * 10


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 3)


X = torch.ones(1, 3)


@pytest.mark.parametrize("removal", list(itertools.permutations(["add", "scale"])), ids=str)
@pytest.mark.parametrize("install", list(itertools.permutations(["add", "scale"])), ids=str)
def test_wrappers_compose_in_install_order_and_come_off_in_any_order(install: tuple[str, ...], removal: tuple[str, ...]) -> None:
    linear = _linear()
    plain = linear(X)
    wrappers = {"add": AddWrapper("add", 1.0), "scale": ScaleWrapper()}
    for name in install:
        install_wrapper(linear, wrappers[name])
    expected = (plain + 1) * 10 if install == ("add", "scale") else plain * 10 + 1  # the last installed is outermost
    torch.testing.assert_close(linear(X), expected)
    remove_wrapper(linear, removal[0])
    remaining = removal[1]
    torch.testing.assert_close(linear(X), plain + 1 if remaining == "add" else plain * 10)
    assert remove_wrapper(linear, remaining)
    assert not remove_wrapper(linear, remaining)
    assert "forward" not in vars(linear)
    torch.testing.assert_close(linear(X), plain)


def test_a_forward_installed_before_us_is_restored_exactly() -> None:
    linear = _linear()
    foreign = lambda x: torch.zeros_like(x)  # noqa: E731 - someone else's instance-level forward
    linear.forward = foreign
    install_wrapper(linear, AddWrapper("add", 1.0))
    torch.testing.assert_close(linear(X), torch.ones(1, 3))
    remove_wrapper(linear, "add")
    assert vars(linear)["forward"] is foreign


def test_a_foreign_wrapper_on_top_keeps_working_after_our_removal() -> None:
    linear = _linear()
    plain = linear(X)
    stack = install_wrapper(linear, AddWrapper("add", 1.0))
    ours = linear.forward
    linear.forward = lambda x: ours(x) * 2  # e.g. a profiler or accelerate hook installed later
    assert remove_wrapper(linear, "add", stack)
    torch.testing.assert_close(linear(X), plain * 2)  # our wrapper is gone, theirs still runs


def test_same_name_twice_is_refused() -> None:
    linear = _linear()
    install_wrapper(linear, AddWrapper("add", 1.0))
    with pytest.raises(RuntimeError, match="Linear already has the forward wrapper 'add' installed"):
        install_wrapper(linear, AddWrapper("add", 2.0))


def test_deepcopy_computes_with_its_own_weights_and_drops_transient_wrappers() -> None:
    linear = _linear()
    install_wrapper(linear, AddWrapper("kept", 1.0, persistent=True))
    install_wrapper(linear, AddWrapper("transient", 100.0, persistent=False))
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    torch.testing.assert_close(twin(X), torch.ones(1, 3))  # its own zero weights + the persistent wrapper only
    assert get_wrapper(twin, "transient") is None and get_wrapper(twin, "kept") is not None
    assert forward_stack(twin).module is twin
    assert linear(X).min() > 50  # the original keeps both


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_round_trip(how: str) -> None:
    linear = _linear()
    install_wrapper(linear, AddWrapper("kept", 1.0))
    install_wrapper(linear, AddWrapper("transient", 100.0, persistent=False))
    if how == "pickle":
        restored = pickle.loads(pickle.dumps(linear))
    else:
        buffer = io.BytesIO()
        torch.save(linear, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(restored(X), linear(X) - 100.0)
