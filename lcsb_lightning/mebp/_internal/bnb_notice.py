"""Drops bitsandbytes' CPU-kernel notice: installed on import of :mod:`lcsb_lightning.mebp`, before peft imports bitsandbytes.

bitsandbytes logs on import, on CPUs with AVX512-BF16, that its optional CPU 4-bit matmul kernel (fetched
from the hub by the ``kernels`` package) is missing. Nothing here uses it (on CPU the 4-bit formats
decompress in plain torch), and peft imports bitsandbytes in every LoRA run, 4-bit or not.
"""

from __future__ import annotations

import logging


class NoCPUKernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# On the logger that emits it: a filter on the "bitsandbytes" parent would not see its children's records.
_logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
if not any(isinstance(existing, NoCPUKernelNotice) for existing in _logger.filters):
    _logger.addFilter(NoCPUKernelNotice())
