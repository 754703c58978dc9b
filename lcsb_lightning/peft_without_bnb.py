"""peft without bitsandbytes' import, for a model that holds no bitsandbytes layer.

peft (0.22) imports bitsandbytes in every ``get_peft_model`` and ``PeftModel.from_pretrained`` when it is
installed, to offer LoRA layers for its 8- and 4-bit ones. Its import pulls in ``torch._dynamo``, sympy and
networkx: 43.5 MiB more anonymous memory after torch, transformers, peft and lightning (peft 0.22.0,
bitsandbytes 0.50.2), in a run that never uses it. A model can hold a bitsandbytes layer only once
bitsandbytes is imported, so until then peft is told it is not installed, and misses nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def peft_without_bitsandbytes() -> Iterator[None]:
    """Within the block, peft finds no bitsandbytes unless it is imported already.

    A ``None`` entry in ``sys.modules`` makes ``importlib.util.find_spec`` answer "not installed" and an
    import fail; it is removed on leaving, and peft's cached answers are cleared, so that a later
    ``import bitsandbytes`` (``QuantizedMeBP(fmt="nf4")``) and peft's bitsandbytes layers work as usual.

    Example::

        >>> import sys
        >>> with peft_without_bitsandbytes():
        ...     pass  # model = get_peft_model(model, LoraConfig(...))
        >>> sys.modules.get("bitsandbytes", "not hidden any more") is not None
        True
    """
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]
        import_utils = sys.modules.get("peft.import_utils")
        for name in ("is_bnb_available", "is_bnb_4bit_available"):
            getattr(getattr(import_utils, name, None), "cache_clear", lambda: None)()
