"""``MeBPConfig``: every option of MeBP's conversion in one validated object (as peft's ``LoraConfig``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Optional, get_args, get_origin, get_type_hints

from lcsb_lightning.mebp._internal.formats import AUTO_GROUP_SIZE, validate_format
from lcsb_lightning.mebp._internal.storage import mmap_supported

# The option types are Literals so that LightningCLI (jsonargparse) lists the choices and refuses another
# value when it parses; a test pins Format to formats.FORMATS.
Format = Literal["auto", "int4", "int4_asym", "nf4", "fp4"]
Offload = Literal["none", "mmap"]
WeightStorage = Literal["auto", "mmap", "ram"]
OFFLOAD_MODES: tuple[str, ...] = get_args(Offload)
WEIGHT_STORAGE: tuple[str, ...] = get_args(WeightStorage)


@dataclass(frozen=True)
class MeBPConfig:
    """How :func:`~lcsb_lightning.mebp.apply_mebp`, :func:`~lcsb_lightning.mebp.load_compressed` and
    :class:`~lcsb_lightning.mebp.QuantizedMeBP` compress a model; checked once, when it is built.

    The fields are the keys of the ``mebp`` Hydra group (``conf/mebp/int4.yaml``). Each function that
    takes a config also takes the fields as keyword arguments: alone they build a config, beside a
    config they override its fields (``dataclasses.replace``). docs/mebp.md says what each costs and saves.

    Args:
        fmt: ``"auto"`` (the default): a GGUF file's own blocks kept as they are where a stored format holds
            them (Q4_0-Q8_0, Q2_K-Q6_K), float weights in ``"int4_asym"``; ``"int4"`` (MeBP's), ``"int4_asym"``
            (a scale and a minimum per group; both plain torch), ``"nf4"`` or ``"fp4"`` (bitsandbytes).
        group_size: Weights per scale of the weights quantized here (32: ``int4_asym`` at 32 is the lowest
            error measured at 5 bits a weight); must divide their layers' input features (``nf4``/``fp4``:
            32, 64, ..., 4096). GGUF blocks kept as they are keep their own.
        checkpoint: Per-block non-reentrant gradient checkpointing.
        offload: ``"none"`` or ``"mmap"`` (a back-propagated block's saved tensors in memory-mapped files).
        compress_embeddings: Also compress the input embedding and LM head.
        ignore_modules: Modules to keep as is, each matched as whole dotted parts of the qualified
            name: ``"lm_head"``, ``"down_proj"`` or ``"model.layers.0"`` (everything under it).
        weights: ``"mmap"``: the compressed weights in memory-mapped files, each layer's pages dropped after
            it ran (CPU, Linux/macOS); ``"ram"``: in process memory; ``"auto"``: memory-mapped for a model that
            trains on the CPU where ``madvise`` exists and ``offload_dir`` is not on tmpfs, decided at fit
            start (at conversion on a machine without an accelerator Lightning would pick).
        keep_recomputed_weights: With ``checkpoint``, keep each Linear's weight decompressed by the
            recompute until its backward; ``False`` decompresses it again there (the same gradients, at most
            one layer's float weight alive at a time, one more decompression per layer).
        release_heap: On CPU, return freed heap memory to the OS around each block's forward and before its
            recompute once the resident set grew by 16 MiB (glibc ``malloc_trim``): a flat resident set, for
            page faults that lengthen the step.
        map_large_allocations: Changes malloc for the **whole process, for good** (glibc
            ``mallopt(M_MMAP_THRESHOLD)`` at 256 KiB): a lower peak, a slower step. Acts from the conversion
            on; warned where it has no effect.
        free_grads_after_step: Set the gradients to ``None`` right after each optimizer step (automatic
            optimization): hooks after the step (``on_before_zero_grad``, ``on_train_batch_end``) see none.
        offload_dir: Parent of the temporary offload and weight directories (default: the system temp dir).
        sync_timing: Synchronise the device around every timed region (exact wall times, a stall per layer
            on a GPU); by default CUDA work is timed with CUDA events.

    Raises:
        ValueError: an unknown ``fmt``, ``offload`` or ``weights``, an unsupported ``group_size``, or
            ``weights="mmap"`` where ``madvise`` is missing.
        TypeError: a flag that is not a bool, ``ignore_modules`` that is not a collection of names.
        ModuleNotFoundError: ``fmt`` needs bitsandbytes and it is missing.

    Example::

        >>> config = MeBPConfig(fmt="int4", group_size=32)
        >>> dataclasses.replace(config, weights="mmap").weights
        'mmap'
        >>> MeBPConfig.from_node({"_target_": "lcsb_lightning.mebp.QuantizedMeBP", "fmt": "int4"}).fmt
        'int4'
    """

    fmt: Format = "auto"
    group_size: int = AUTO_GROUP_SIZE
    checkpoint: bool = True
    offload: Offload = "none"
    compress_embeddings: bool = True
    ignore_modules: tuple[str, ...] = ()
    weights: WeightStorage = "auto"
    keep_recomputed_weights: bool = True
    release_heap: bool = True
    map_large_allocations: bool = False
    free_grads_after_step: bool = False
    offload_dir: Optional[str] = None
    sync_timing: bool = False

    def __post_init__(self) -> None:
        validate_format(self.fmt, self.group_size)
        for name, kind in get_type_hints(MeBPConfig).items():
            value = getattr(self, name)
            if kind is bool and not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}.")
            if get_origin(kind) is Literal and value not in get_args(kind):
                choices = ", ".join(map(repr, get_args(kind)))
                raise ValueError(f"`{name}={value!r}` is not supported; choose one of {choices}.")
        if self.weights == "mmap" and not mmap_supported():
            raise ValueError("`weights='mmap'` needs madvise (Linux or macOS); use `weights='ram'` here.")
        names: Any = self.ignore_modules
        if not isinstance(names, str) and isinstance(names, Iterable):
            names = tuple(names)  # a list, a generator, or Hydra's ListConfig
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"`ignore_modules` must be a collection of module names, got {self.ignore_modules!r}.")
        object.__setattr__(self, "ignore_modules", names)
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)):
                raise TypeError(f"`offload_dir` must be a directory path or None, got {self.offload_dir!r}.")
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> MeBPConfig:
        """The config of an ``mebp`` Hydra node (or any mapping), Hydra's ``_target_``-style keys ignored.

        Raises:
            TypeError: a key that is not a field (the message lists the fields), or a bad value as
                in :class:`MeBPConfig`.
        """
        return build_config(None, {key: value for key, value in node.items() if not str(key).startswith("_")})


#: MeBPConfig's defaults, as the default of a ``config`` argument: signatures (and LightningCLI's
#: ``--print_config``) show every field's value. A plain, checked config: options beside it override its fields.
DEFAULT_CONFIG = MeBPConfig()


def build_config(config: MeBPConfig | None, options: Mapping[str, Any], caller: str = "MeBPConfig") -> MeBPConfig:
    """``config`` with ``options`` (keyword arguments named like its fields) applied; a new one without it."""
    if config is not None and not isinstance(config, MeBPConfig):
        raise TypeError(f"{caller}: `config` must be a MeBPConfig or None, got {type(config).__name__}; pass the "
                        "options (fmt=..., group_size=...) by keyword.")
    fields = tuple(field.name for field in dataclasses.fields(MeBPConfig))
    unknown = [name for name in options if name not in fields]
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {', '.join(map(repr, unknown))}; the MeBPConfig fields are "
                        f"{', '.join(fields)}.")
    if config is None:
        return MeBPConfig(**options)
    return dataclasses.replace(config, **options) if options else config
