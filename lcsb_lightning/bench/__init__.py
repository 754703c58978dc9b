"""Reproduction benchmark (``lcsb-benchmark``): quality, speed/memory and 4-bit stability studies.

Modules: :mod:`~lcsb_lightning.bench.spec` (arms, resume and divergence rules, pure),
:mod:`~lcsb_lightning.bench.recorder` (per-step curves and evaluations at fixed steps and
wall-clock budgets), :mod:`~lcsb_lightning.bench.finetune_arm` (one quality or stability arm
through ``run_finetune``), :mod:`~lcsb_lightning.bench.memory` (peak memory, one process per arm),
:mod:`~lcsb_lightning.bench.cost_model` (the step-cost model ``a + b·d`` across shapes, and its projection),
:mod:`~lcsb_lightning.bench.report` (tables, ``results.md`` and ``results.json``),
:mod:`~lcsb_lightning.bench.plots` (PNG figures) and :mod:`~lcsb_lightning.bench.runner` (the resumable driver).
"""
