"""bitsandbytes stays unimported in a run that does not choose nf4/fp4, even where it is installed: peft (0.22)
imports it in every ``get_peft_model`` to offer its layers, and its import takes some 40 MB (torch._dynamo,
sympy, networkx)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed: nothing to keep unimported")


def _python(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_lora_on_a_float_model_does_not_import_bitsandbytes() -> None:
    """A fresh process injects LoRA (and loads an adapter) without bitsandbytes; afterwards peft and bitsandbytes
    still work as if nothing had happened (peft's cached availability says installed; the import succeeds)."""
    assert _python("""
        import sys, tempfile
        from peft import LoraConfig, PeftModel, get_peft_model
        from peft.import_utils import is_bnb_4bit_available
        from transformers import LlamaConfig, LlamaForCausalLM
        from lcsb_lightning.peft_without_bnb import peft_without_bitsandbytes

        def tiny():
            return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2))
        with peft_without_bitsandbytes():
            model = get_peft_model(tiny(), LoraConfig(r=2, target_modules="all-linear"))
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            with peft_without_bitsandbytes():
                PeftModel.from_pretrained(tiny(), folder)
        print("bitsandbytes imported:", "bitsandbytes" in sys.modules)
        import bitsandbytes
        print("then available:", is_bnb_4bit_available())
    """) == ["bitsandbytes imported: False", "then available: True"]


@pytest.mark.slow
def test_a_recipe_run_imports_bitsandbytes_only_for_nf4(tmp_path: Path) -> None:
    """Whole runs, one after another in one process: ``mebp=none`` and ``int4`` leave it alone, ``nf4`` imports it."""
    assert _python(f"""
        import sys
        sys.path.insert(0, "tests")
        from _recipes_utils import FAST, compose_cfg
        from lcsb_lightning.recipes.train import run_finetune

        for mebp in ("none", "int4", "nf4"):
            run_finetune(compose_cfg([*FAST, "task=pydoc", "trainer.max_steps=2", f"mebp={{mebp}}"]), {str(tmp_path)!r} + "/" + mebp)
            print(mebp, "imports bitsandbytes:", "bitsandbytes" in sys.modules)
    """)[-3:] == ["none imports bitsandbytes: False", "int4 imports bitsandbytes: False", "nf4 imports bitsandbytes: True"]
