"""The docstring examples of the core modules run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "lcsb_lightning.blocks",
    "lcsb_lightning.selective",
    "lcsb_lightning.controller",
    "lcsb_lightning.selection_image",
    "lcsb_lightning.policies.base",
    "lcsb_lightning.policies.simple",
    "lcsb_lightning.policies.stochastic",
    "lcsb_lightning.bench.spec",
    "lcsb_lightning.bench.cost_model",
    "lcsb_lightning.bench.time_to_quality",
    "lcsb_lightning.forward_wrap",
    "lcsb_lightning.recipes.config",
    "lcsb_lightning.validation",
    "lcsb_lightning.process_memory",
    "lcsb_lightning.peft_without_bnb",
    "lcsb_lightning.heap_trim",
    "lcsb_lightning.recompute",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name: str) -> None:
    result = doctest.testmod(importlib.import_module(module_name), raise_on_error=False)
    assert result.attempted > 0, f"{module_name} has no runnable example"
    assert result.failed == 0
