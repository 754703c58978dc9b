"""MeBP's memory internals (formats, buffers, heap, storage, offload, timers, block checkpointing).

Nothing here is public API: import from :mod:`lcsb_lightning.mebp`; these modules may change without notice.
"""
