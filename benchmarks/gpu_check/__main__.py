"""``python -m benchmarks.gpu_check [--steps 20] ...``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
