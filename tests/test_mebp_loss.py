"""chunked_lm_loss equals the full cross-entropy, also through a compressed LM head."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lcsb_lightning.mebp import chunked_lm_loss
from lcsb_lightning.mebp.compressed import CompressedLinear


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("head_kind", ["frozen", "compressed", "trainable", "callable"])
def test_chunked_loss_and_gradient_equal_full_loss(chunk_size: int, head_kind: str) -> None:
    torch.manual_seed(0)
    head: nn.Module = nn.Linear(32, 50, bias=True).requires_grad_(head_kind == "trainable")
    if head_kind == "compressed":
        head = CompressedLinear.from_linear(head, "int4", 32)
        head.max_chunk_elements = 32 * 16  # stream the vocabulary in blocks of 16 rows
    elif head_kind == "callable":
        linear = head
        head = lambda h: linear(h)  # noqa: E731  (any callable: checkpointed per chunk)
    hidden = torch.randn(2, 9, 32, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, 3] = -100
    reference_hidden = hidden.detach().clone().requires_grad_(True)
    logits = head(reference_hidden)
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss = chunked_lm_loss(hidden, head, labels, chunk_size=chunk_size)
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)
    if head_kind == "trainable":
        assert head.weight.grad is not None


def test_streamed_head_decompresses_once_per_chunk_and_not_in_backward() -> None:
    head = CompressedLinear.from_linear(nn.Linear(32, 64), "int4", 32)
    head.max_chunk_elements = 32 * 16  # four vocabulary blocks
    hidden = torch.randn(1, 9, 32, requires_grad=True)
    chunked_lm_loss(hidden, head, torch.randint(0, 64, (1, 9)), chunk_size=16).backward()
    assert head.decompress_count == {"forward": 1, "backward": 0}
    with torch.no_grad():  # evaluation: 8 shifted tokens in 2 chunks, one decompression each
        chunked_lm_loss(hidden, head, torch.randint(0, 64, (1, 9)), chunk_size=4)
    assert head.decompress_count == {"forward": 3, "backward": 0}


@pytest.mark.parametrize(
    ("hidden_shape", "labels_shape", "chunk_size", "match"),
    [
        ((2, 4, 8), (2, 4), 0, r"`chunk_size` must be an integer >= 1, got 0"),
        ((2, 4, 8), (2, 5), 4, r"Expected `hidden_states` \(batch, seq, hidden\) and `labels` \(batch, seq\)"),
    ],
)
def test_chunked_loss_errors(hidden_shape: tuple, labels_shape: tuple, chunk_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunked_lm_loss(torch.randn(hidden_shape), nn.Linear(8, 10), torch.zeros(labels_shape, dtype=torch.long), chunk_size)


def test_out_of_range_labels_are_refused() -> None:
    hidden = torch.randn(1, 5, 8)
    labels = torch.tensor([[1, 2, -100, 10, 3]])  # 10 is outside a 10-word vocabulary
    for head in (nn.Linear(8, 10).requires_grad_(False), nn.Linear(8, 10)):
        with pytest.raises(ValueError, match=r"label 10 is outside the vocabulary of 10 \(ids 0\.\.9\); only -100"):
            chunked_lm_loss(hidden, head, labels, chunk_size=2)
    with pytest.raises(ValueError, match=r"label -3 is outside the vocabulary"):
        chunked_lm_loss(hidden, nn.Linear(8, 10), torch.tensor([[1, -3, 2, 2, 2]]), chunk_size=2)


def _tiny_causal_lm(arch: str) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.5)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=8, final_logit_softcapping=0.7)),
        "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.3)),
    }
    torch.manual_seed(0)
    return configs[arch]().float().eval()


@pytest.mark.parametrize("head_kind", ["frozen", "trainable"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3", "cohere"])
def test_chunked_loss_equals_the_models_own_loss(arch: str, head_kind: str) -> None:
    from lcsb_lightning.mebp import logit_transform

    model = _tiny_causal_lm(arch)
    with torch.no_grad():  # logits of a few units, where a softcap of 0.5-0.7 bends them hard
        model.get_output_embeddings().weight.mul_(50)
    model.get_output_embeddings().requires_grad_(head_kind == "trainable")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    reference = model(input_ids=ids, labels=labels).loss
    reference_grads = torch.autograd.grad(reference, params)
    hidden = model.model(input_ids=ids).last_hidden_state
    loss = chunked_lm_loss(hidden, model.get_output_embeddings(), labels, chunk_size=5, **logit_transform(model))
    torch.testing.assert_close(loss, reference)
    for grad, reference_grad in zip(torch.autograd.grad(loss, params, allow_unused=True), reference_grads):
        torch.testing.assert_close(grad if grad is not None else torch.zeros_like(reference_grad), reference_grad,
                                   atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("head_kind", ["linear", "compressed", "callable"])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.5, 3.0)])
def test_lm_head_predictions_equal_the_full_logits(monkeypatch: pytest.MonkeyPatch, head_kind: str, scale: float,
                                                   softcap: float | None) -> None:
    """Per-position NLL and argmax of the evaluation, streamed over vocabulary blocks of 128 rows (8 blocks)."""
    from lcsb_lightning.mebp import loss
    from lcsb_lightning.mebp.compressed import CompressedLinear

    monkeypatch.setattr(loss, "VOCAB_BLOCK_ELEMENTS", 64 * 128)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 1000).requires_grad_(False)
    head: Any = {"linear": linear, "compressed": CompressedLinear.from_linear(linear, "int4", 32)}.get(head_kind, None)
    weight = head.decompress() if head_kind == "compressed" else linear.weight
    if head is None:
        head = lambda x: F.linear(x, weight, linear.bias)  # noqa: E731
    hidden, targets = torch.randn(50, 64), torch.randint(0, 1000, (50,))
    targets[[3, 7]] = -100
    logits = F.linear(hidden, weight, linear.bias) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    nll, best = loss.lm_head_predictions(hidden, head, targets, scale, softcap)
    expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(best, logits.argmax(1)) and float(nll[3]) == 0.0


@pytest.mark.parametrize("head_kind", ["linear", "callable"])
def test_lm_head_predictions_refuse_a_target_outside_the_vocabulary_as_the_loss_does(head_kind: str) -> None:
    from lcsb_lightning.mebp import loss

    linear = torch.nn.Linear(16, 40).requires_grad_(False)
    head: Any = linear if head_kind == "linear" else (lambda x: linear(x))
    targets = torch.tensor([3, -100, 40])
    with pytest.raises(ValueError, match=r"label 40 is outside the vocabulary of 40 \(ids 0..39\)"):
        loss.lm_head_predictions(torch.randn(3, 16), head, targets)
    with pytest.raises(ValueError, match=r"label 40 is outside the vocabulary of 40 \(ids 0..39\)"):
        chunked_lm_loss(torch.randn(1, 3, 16), head, targets[None], shift_labels=False)


def test_streamed_loss_under_bf16_autocast_is_the_float_loss() -> None:
    # the head's logits come out of autocast in bf16: the online log-sum-exp keeps float32 (found by
    # test_bf16_mixed_int4_run_on_cpu once the recipes streamed their training loss by default)
    torch.manual_seed(0)
    head = nn.Linear(16, 40).requires_grad_(False)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    expected = chunked_lm_loss(hidden, head, labels, chunk_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_lm_loss(hidden, head, labels, chunk_size=4)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad is not None
    assert abs(float(loss) - float(expected)) < 0.05


def _bytes_allocated(fn: Any) -> int:
    """Bytes of the new storages that the ops run by ``fn`` returned (an op writing into a tensor it was given,
    or returning a view of one, allocates nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Allocations(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tree_leaves(out)
                     if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given}
            Allocations.total += sum(fresh.values())
            return out

    with Allocations():
        fn()
    return Allocations.total


@pytest.mark.parametrize("call", ["loss", "predictions"])
def test_the_vocabulary_blocks_reuse_their_buffers(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """A block's logits and exponentials go into buffers the blocks share: allocating them anew per block churned
    through the main job's fragmented heap and made 100 MiB of its free pages resident at every step."""
    from lcsb_lightning.mebp import loss

    torch.manual_seed(0)
    head = nn.Linear(32, 4096, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 65, 32, requires_grad=True)
    labels = torch.randint(0, 4096, (1, 65))
    block_bytes = 64 * 256 * 4  # 64 positions x 256 vocabulary rows, float32

    def run() -> None:
        if call == "loss":
            chunked_lm_loss(hidden, head, labels, chunk_size=64)
        else:
            loss.lm_head_predictions(hidden[0, :64].detach(), head, labels[0, 1:])

    run()
    monkeypatch.setattr(loss, "VOCAB_BLOCK_ELEMENTS", 32 * 256)  # 16 blocks
    allocated = _bytes_allocated(run)
    assert allocated < 4 * block_bytes, f"{allocated} bytes for 16 blocks of {block_bytes}"


def test_the_shared_buffers_give_the_same_loss_and_gradient_bit_for_bit() -> None:
    """Against the blocks' own allocations (the path under autocast): the same kernels, the same bits."""
    from lcsb_lightning.mebp import loss

    torch.manual_seed(0)
    head = nn.Linear(32, 1000).requires_grad_(False)
    hidden = torch.randn(48, 32)
    labels = torch.randint(0, 1000, (48,))
    results = []
    for scratch in (None, loss._BlockScratch()):
        h = hidden.clone().requires_grad_(True)
        value = loss._StreamingLinearCrossEntropy.apply(h, labels, head, -100, 1.0, None, scratch)
        value.backward()
        results.append((value.detach(), h.grad))
    for plain, shared in zip(*results):
        assert torch.equal(plain, shared)
