"""A run's GGUF files through llama.cpp, side by side with the project's own model (the run's ``adapter/``).

For a run whose base model came from a GGUF file (``summary.json``'s ``gguf``), with ``llama-cpp-python`` 0.3.36::

    python benchmarks/llama_cpp_agreement.py outputs/finetune/<run> --text ../shared/data/wikitext-2/test.txt

prints, over the same token ids on both sides:
- llama.cpp's logits over an F32 copy of the base file (made once with llama.cpp's quantizer) against the
  project's float model, without and with ``adapter.gguf`` (the goal: within twice the base's difference), and
  how far the adapter's change of the logits differs (the goal: 2%);
- the NLL of the text through the base file itself, without and with the adapter, on both sides;
- with ``merged.gguf``: its logits against the project's adapted model, beside the base file's against the base.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))


def main() -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    from lcsb_lightning.export.llama_cpp import llama_cpp_logits, requantize, token_nll
    from lcsb_lightning.mebp.loading import load_float

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a lcsb-finetune run folder")
    parser.add_argument("--text", type=Path, default=None, help="held-out text (default: Python's own documentation)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "lcsb-llama-cpp")
    args = parser.parse_args()

    gguf = json.loads((args.run / "summary.json").read_text()).get("gguf")
    if not gguf:
        raise SystemExit(f"{args.run}: the run's base model was not read from a GGUF file (summary.json has no gguf)")
    base = Path(gguf["base"])
    args.work_dir.mkdir(parents=True, exist_ok=True)
    f32 = args.work_dir / f"{base.stem}.F32.gguf"
    if not f32.is_file():
        requantize(base, f32, "ALL_F32")
    if args.text is not None:
        text = args.text.read_text()
    else:
        from pydoc_data.topics import topics

        text = "\n".join(topics[key] for key in sorted(topics)[40:60])
    tokenizer = AutoTokenizer.from_pretrained(str(base.parent), gguf_file=base.name)
    tokens = tokenizer(text[: 20 * args.tokens]).input_ids[: args.tokens]

    model = load_float(base)
    with torch.no_grad():
        ours_base = model(torch.tensor([tokens])).logits[0].float().numpy()
        adapted = PeftModel.from_pretrained(model, str(args.run / "adapter")).eval()
        ours = adapted(torch.tensor([tokens])).logits[0].float().numpy()
    adapter = args.run / "adapter.gguf"
    theirs_base, theirs = llama_cpp_logits(f32, tokens), llama_cpp_logits(f32, tokens, adapter)
    change = np.linalg.norm((theirs - theirs_base) - (ours - ours_base)) / np.linalg.norm(ours - ours_base)
    print(f"{len(tokens)} tokens; run {args.run}")
    print(f"F32 base, max |llama.cpp - project| logits: base {np.abs(theirs_base - ours_base).max():.2e}, "
          f"with the adapter {np.abs(theirs - ours).max():.2e}; the adapter's change differs by {change:.2%}")
    q_base, q_adapted = llama_cpp_logits(base, tokens), llama_cpp_logits(base, tokens, adapter)
    print(f"NLL through {base.name}: llama.cpp {token_nll(q_base, tokens):.4f} -> {token_nll(q_adapted, tokens):.4f}, "
          f"project {token_nll(ours_base, tokens):.4f} -> {token_nll(ours, tokens):.4f}")
    merged = args.run / "merged.gguf"
    if merged.is_file():
        print(f"rms |llama.cpp - project| logits: merged.gguf vs adapted {_rms(llama_cpp_logits(merged, tokens) - ours):.3e}, "
              f"{base.name} vs base {_rms(q_base - ours_base):.3e}")


if __name__ == "__main__":
    main()
