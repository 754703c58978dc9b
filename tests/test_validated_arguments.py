"""Every argument ``check_int`` validates is used in its validated form: a whole float (``4.0``) works as the
integer it names, anything else is refused with a ValueError naming the argument, before any work."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lcsb_lightning import LCSBCallback
from lcsb_lightning.bench.recipe_speed import time_task
from lcsb_lightning.guard import DivergenceGuard
from lcsb_lightning.mebp.loss import chunked_lm_loss
from lcsb_lightning.policies import CyclicPolicy, DyadicPolicy, GradNormPolicy
from lcsb_lightning.recipes.tasks.base import Task


def _loss(chunk_size: Any) -> torch.Tensor:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50).requires_grad_(False)
    return chunked_lm_loss(torch.randn(2, 6, 8), head, torch.randint(0, 50, (2, 6)), chunk_size=chunk_size)


class _Composed(Exception):
    pass


def _compose(overrides: list[str]) -> Any:
    raise _Composed(overrides)


def _max_steps(steps_per_round: Any) -> int:
    """The ``trainer.max_steps`` that ``time_task`` composes an arm with (it stops there)."""
    with pytest.raises(_Composed) as composed:
        time_task("pydoc", {"full": []}, [], _compose, 1, steps_per_round, None)
    (max_steps,) = [o for o in composed.value.args[0] if o.startswith("trainer.max_steps=")]
    return int(max_steps.split("=")[1]) if max_steps.split("=")[1].isdigit() else max_steps


#: name -> (call with the argument's value, what the call gives that must not depend on int vs whole float)
CALLS: dict[str, Callable[[Any], Any]] = {
    "chunk_size": _loss,
    "max_train_examples": lambda v: Task(max_train_examples=v).max_train_examples,
    "max_eval_examples": lambda v: Task(max_eval_examples=v).max_eval_examples,
    "levels": lambda v: DyadicPolicy(levels=v).levels,
    "switch_every": lambda v: CyclicPolicy(layers_per_step=1, switch_every=v).switch_every,
    "layers_per_step": lambda v: CyclicPolicy(layers_per_step=v).layers_per_step,
    "max_staleness": lambda v: GradNormPolicy(layers_per_step=1, max_staleness=v).max_staleness,
    "log_every_n_steps": lambda v: LCSBCallback(log_every_n_steps=v).log_every_n_steps,
    "probe_every": lambda v: LCSBCallback(probe_every=v).probe_every,
    "window": lambda v: DivergenceGuard(window=v).window,
    "patience": lambda v: DivergenceGuard(patience=v).patience,
    "steps_per_round": _max_steps,
    "rounds": lambda v: time_task("pydoc", {}, [], _compose, v, 4, None),
}


@pytest.mark.parametrize("name", [n for n in CALLS if n != "rounds"])
def test_a_whole_float_is_used_as_its_integer(name: str) -> None:
    given, expected = CALLS[name](4.0), CALLS[name](4)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(given, expected)
    else:
        assert type(given) is int and given == expected


@pytest.mark.parametrize("bad", [4.5, "4", True, -1])
@pytest.mark.parametrize("name", list(CALLS))
def test_anything_else_is_refused_naming_the_argument(name: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"`{name}` must be an integer >= \d, got {bad!r}"):
        CALLS[name](bad)
