"""Drops bitsandbytes' notice, logged on import on CPUs with AVX512-BF16, that its optional CPU 4-bit kernel is
missing: nothing here uses it, and peft imports bitsandbytes in every LoRA run."""

from __future__ import annotations

import logging


class NoCPUKernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


# On the logger that emits it: a filter on the "bitsandbytes" parent would not see its children's records.
_logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
if not any(isinstance(existing, NoCPUKernelNotice) for existing in _logger.filters):
    _logger.addFilter(NoCPUKernelNotice())
