"""A quiet first run: bitsandbytes is imported only for a 4-bit format (or by peft), and its notice
about an optional CPU kernel (printed on CPUs with AVX512-BF16), which no run here can act on, is not shown."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


def test_core_and_recipe_building_without_4bit_do_not_import_bitsandbytes(tmp_path: Path) -> None:
    """``import lcsb_lightning``, and the recipes' modules, config checks, model, LoRA (peft, which imports
    bitsandbytes where it is installed unless kept from it) and Trainer of an ``mebp=none`` run leave
    bitsandbytes alone; ``mebp=nf4``'s plugin imports it."""
    result = _python(f"""
        import sys
        sys.path.insert(0, "tests")
        import lcsb_lightning
        assert "bitsandbytes" not in sys.modules, "import lcsb_lightning"
        from _recipes_utils import FAST, compose_cfg
        from lcsb_lightning.recipes import cli, train
        from lcsb_lightning.recipes.config import check_config
        for mebp in ("none", "nf4"):
            cfg = compose_cfg([*FAST, f"mebp={{mebp}}", "task=pydoc"])
            check_config(cfg)
            if mebp == "none":
                train.prepare(cfg)
            train.build_trainer(cfg, {str(tmp_path)!r} + "/" + mebp)
            print(mebp, "imports bitsandbytes:", "bitsandbytes" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["none imports bitsandbytes: False", "nf4 imports bitsandbytes: True"]


def test_the_cpu_kernel_notice_is_filtered(caplog: pytest.LogCaptureFixture) -> None:
    import lcsb_lightning.mebp._internal.bnb_notice  # noqa: F401  (installs the filter)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(f"{NOTICE}: %s. Please make sure you already `pip install kernels`", "No module named 'kernels'")
        logger.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes warning"]


def test_a_recipe_run_importing_peft_prints_no_cpu_kernel_notice() -> None:
    """As the recipes run: their modules first, then peft (which imports bitsandbytes). Checked where bitsandbytes
    imported alone prints the notice (a CPU with AVX512-BF16, this machine's); skipped elsewhere, saying so."""
    bare = _python("import bitsandbytes")
    if NOTICE not in bare.stderr + bare.stdout:
        pytest.skip("bitsandbytes prints no CPU-kernel notice here (it needs AVX512-BF16): nothing to filter")
    result = _python("""
        import lcsb_lightning.recipes.train
        import peft
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert NOTICE not in result.stderr + result.stdout
