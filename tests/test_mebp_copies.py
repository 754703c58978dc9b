"""Copies (``copy.deepcopy``, pickle) of a model converted with ``weights="mmap"``: EMA, SWA and
checkpointing whole modules copy a model, and the copy must train as the original does.

A copy's codes are ordinary heap tensors; releasing them as if they were the store's mappings
(``madvise(MADV_DONTNEED)``) zeroes heap pages and aborts the process, so the training runs in a
subprocess that the suite survives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lcsb_lightning.mebp._internal.stored import Packed
from lcsb_lightning.mebp._internal.storage import MappedWeights, mmap_supported

pytestmark = pytest.mark.skipif(not mmap_supported(), reason="weights='mmap' needs madvise (Linux/macOS)")

_TRAIN_COPIES = textwrap.dedent(
    """
    import copy, pickle, sys
    import torch
    sys.path.insert(0, {tests!r})
    from _mebp_utils import add_lora, tiny_llama, tokens
    from lcsb_lightning.mebp import apply_mebp, chunked_lm_loss

    def step(model, ids):
        causal_lm = model.get_base_model()
        hidden = causal_lm.model(input_ids=ids).last_hidden_state
        loss = chunked_lm_loss(hidden, causal_lm.get_output_embeddings(), ids, chunk_size=8)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p -= 0.5 * p.grad
                    p.grad = None
        return loss.detach(), grads

    base = add_lora(tiny_llama(num_layers=3))
    ram = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32)
    mapped = apply_mebp(copy.deepcopy(base), fmt="int4", group_size=32, weights="mmap")
    models = {{"ram": ram, "mmap": mapped}}
    models["deepcopy"] = copy.deepcopy(mapped)
    models["pickle"] = pickle.loads(pickle.dumps(mapped))
    for number in range(3):
        ids = tokens(seed=number)
        results = {{name: step(model, ids) for name, model in models.items()}}
        loss, grads = results["ram"]
        for name, (other_loss, other_grads) in results.items():
            assert torch.equal(other_loss, loss), (number, name, float(other_loss), float(loss))
            assert len(other_grads) == len(grads) > 0
            assert all(torch.equal(a, b) for a, b in zip(other_grads, grads)), (number, name)
    print("ok")
    """
)


def test_copies_of_an_mmap_model_train_exactly_like_the_original() -> None:
    script = _TRAIN_COPIES.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def test_the_store_releases_only_the_mappings_it_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    def madvise(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        return 0

    monkeypatch.setattr("lcsb_lightning.mebp._internal.storage._MADVISE", madvise)
    store = MappedWeights()
    try:
        mapped = store.map(Packed(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 1))).codes
        calls.clear()
        store.release(torch.zeros(4, 8, dtype=torch.uint8))  # a heap tensor, like a copy's codes
        store.release(mapped.clone())
        assert calls == []
        store.release(mapped[1:])  # a view of a mapping releases the whole mapping
        assert calls == [(mapped.untyped_storage().data_ptr(), 32)]
        other = MappedWeights()
        try:
            other.release(mapped)  # another store's mapping is not this store's to release
            assert calls == [(mapped.untyped_storage().data_ptr(), 32)]
        finally:
            other.close()
    finally:
        store.close()
