"""GPU check of the MeBP path: peak CUDA memory and step time of ``qlora``, ``mebp`` and ``mebp_lcsb``.

``benchmarks/gpu_check.sh`` runs the CUDA tests, then ``python -m benchmarks.gpu_check``. Not installed with
lcsb_lightning: :mod:`.cli` (arguments, preflight, main), :mod:`.arms` (building, stepping and timing the
arms), :mod:`.report` (speed-ups, JSON, table).

Every arm trains LoRA (r8, all seven projections) on one seeded random init saved as a safetensors
folder, batch 1, AdamW, in the same plain torch loop. ``qlora``: ``from_pretrained`` + bitsandbytes
nf4 + HF's non-reentrant gradient checkpointing, HF's loss. ``mebp``: ``load_compressed(fmt="nf4",
group_size=64)`` (``QuantizedMeBP.convert_module`` leaves it as it is) with its per-block
checkpointing, ``chunked_lm_loss``, full backprop. ``mebp_lcsb``: the same + the controller
``LCSBCallback("cyclic", fraction=0.25)`` builds, called as the callback calls it.

Why no Trainer: ``QuantizedMeBP`` is itself a ``Precision`` plugin fixed at ``"32-true"``, so
``Trainer(precision="bf16-true", plugins=[QuantizedMeBP()])`` is refused (a precision flag and a
precision plugin), and Trainers cannot alternate arms step by step. The arms are built and warmed up
one after another, then their measured steps alternate round-robin (the order rotating per round);
where each figure comes from is in :data:`SOURCES`, printed under the table and written to the JSON.
"""
