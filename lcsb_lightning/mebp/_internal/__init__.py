"""MeBP's memory internals; not public API: import from :mod:`lcsb_lightning.mebp`."""
