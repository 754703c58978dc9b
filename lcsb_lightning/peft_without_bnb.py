"""peft without bitsandbytes' import, for a model that holds no bitsandbytes layer.

peft (0.22) imports bitsandbytes in ``get_peft_model`` and ``PeftModel.from_pretrained`` whenever it is installed,
pulling in ``torch._dynamo``, sympy and networkx: 43.5 MiB more anonymous memory in a run that never uses it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def peft_without_bitsandbytes() -> Iterator[None]:
    """Within the block, peft finds no bitsandbytes unless it is imported already (a ``None`` entry in
    ``sys.modules``, removed on leaving with peft's cached answers, so that a later import works as usual).

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
