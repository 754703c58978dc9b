"""Tiny seeded models for the MeBP tests."""

from __future__ import annotations

import torch
from torch import nn



def tiny_config(num_layers: int = 4, tie: bool = True, vocab: int = 96):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, use_cache=False,
    )


def tiny_llama(num_layers: int = 4, tie: bool = True, seed: int = 0) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(num_layers, tie)).float()


def add_lora(model: nn.Module, seed: int = 1) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, param in peft_model.named_parameters():  # non-zero B so that every LoRA weight gets a gradient
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    return peft_model


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def tokens(batch: int = 2, seq: int = 16, vocab: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- GGUF files written as llama.cpp's converter writes them (shared by the GGUF loading tests) ---

#: Byte offsets of the fp16 super-block scales (d, dmin) in one K-quant block, and their magnitude
#: (gguf.quants' dequantize_blocks layouts); gguf cannot quantize to these types, so the tests write
#: random blocks whose scale fields are overwritten with small finite values.
KQUANT_SCALES: dict[str, tuple[tuple[int, ...], float]] = {
    "Q2_K": ((80, 82), 1e-3), "Q3_K": ((108,), 1e-3), "Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 1e-4),
    "Q6_K": ((208,), 1e-5), "IQ4_NL": ((0,), 1e-3),  # IQ4_NL: no stored twin, quantized a second time
}


def gguf_model(arch: str = "llama", tie: bool = True, seed: int = 0) -> nn.Module:
    """A tiny float32 causal LM of GGUF architecture ``arch`` with K-quant-compatible widths (256, 512),
    2 layers, vocab 96, and random norm weights and biases (so value transforms are visible)."""
    import transformers as tf

    common = {"vocab_size": 96, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "tie_word_embeddings": tie, "use_cache": False}
    configs = {"llama": lambda: tf.LlamaConfig(**common), "qwen2": lambda: tf.Qwen2Config(**common),
               "gemma2": lambda: tf.Gemma2Config(head_dim=64, **common),
               "gemma3": lambda: tf.Gemma3TextConfig(head_dim=64, **common)}
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(configs[arch]()).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.normal_(0.0, 0.1)
    return model


def _random_blocks(rows: int, cols: int, quant: str, rng: np.random.Generator) -> np.ndarray:  # noqa: F821
    """Random packed bytes of type ``quant``; a K-quant's fp16 scale fields get small finite values."""
    import gguf
    import numpy as np

    block_size, type_size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, quant)]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    offsets, scale = KQUANT_SCALES.get(quant, ((), 0.0))
    for offset in offsets:
        values = (rng.uniform(0.5, 1.0, size=blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset : offset + 2] = values[..., None].view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(model: nn.Module, path: str | os.PathLike[str], quant: str = "F32", arch: str = "llama",  # noqa: F821
                    seed: int = 0, types: dict[str, str] | None = None, name: str = "tiny-test") -> None:
    """Write ``model`` as llama.cpp's converter would: gguf's tensor names, Q/K rows permuted (llama),
    Gemma norm weights stored + 1; 2-D weights in ``quant`` or ``types[gguf_name]`` (quantized with
    ``gguf.quants.quantize``, or random valid blocks for the types gguf cannot quantize, such as the
    K-quants), 1-D ones in F32. transformers reads a ``llama`` file named ``mistral`` as a Mistral model."""
    import gguf
    import numpy as np

    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch.startswith("gemma"):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    for hf_name, tensor in model.named_parameters():  # a tied lm_head is skipped: no `output.weight`
        base, _, suffix = hf_name.rpartition(".")
        name = f"{name_map.get_name(base)}.{suffix}"
        array = tensor.detach().float().numpy().copy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            array = array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1
        kind = (types or {}).get(name, quant)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if array.ndim == 1 or kind == "F32":
            writer.add_tensor(name, array)
        elif kind in KQUANT_SCALES or kind in ("Q8_1", "Q8_K"):
            writer.add_tensor(name, _random_blocks(*array.shape, kind, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
