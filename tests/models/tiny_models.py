"""Tiny random-weight mlx-lm models for tests, built offline and deterministically.

Three kinds, each a normal Hugging Face style model folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a
ChatML chat template) that ``mlx_lm.load(path)`` loads without network:

- ``"llama"``: standard attention; every layer uses ``KVCache``.
- ``"gemma3_text"``: sliding-window attention; layers ``[Rotating, Rotating, KV]``
  x2 (``sliding_window_pattern=3``) with a 16-token window, so short prompts slide.
- ``"hybrid"``: ``nemotron_h`` with the layer pattern ``M*M*`` (Mamba2 SSM,
  attention, SSM, attention): caches ``[ArraysCache, KVCache, ArraysCache, KVCache]``.
- ``"scripted"``: a one-layer, one-head llama with a 128K window (real clients' prompts
  of 30-50K tokens prefill in seconds) whose weights are set so that greedy decoding
  after a newline (the end of the ChatML generation prompt) always answers
  ``SCRIPTED_REPLY`` and then ends with the EOS token, whatever the prompt: each reply
  token's embedding carries a large value in a dimension of its own, and the output row
  of the token that should follow it reads that dimension.

All share one byte-level BPE tokenizer trained with ``tokenizers`` on text
generated here from a fixed seed (no files of the host are read, so the models
are identical on every machine). Weights are float32, initialised from
``mx.random.seed``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Bump when the models or the tokenizer change: the on-disk cache folder name carries it.
TINY_MODELS_VERSION = 1
KINDS = ("llama", "gemma3_text", "hybrid", "scripted")
VOCAB_SIZE = 1024
CONTEXT_LENGTH = 4096
LONG_CONTEXT_LENGTH = 131072  # the "scripted" model's window
SCRIPTED_REPLY = "Hello from the tiny model."
SLIDING_WINDOW = 16
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML. String contents, or a list of {"type": "text", "text": ...} parts.
# Tools (if any) are listed in a system block so a change of tools changes the prompt.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the of and to in is it that for on was with as be at by this from or have an "
    "are not but had they his her she he you we all were when there can one which "
    "their what so up out if about who get make go me time know take see come think "
    "look want give use find tell ask work seem feel try leave call good new first "
    "last long great little own other old right big high different small large next "
    "early young important few public bad same able cache prompt token model block "
    "memory disk server request response chat user assistant system message hello "
    "world capital city country France Paris Germany Berlin Italy Rome Spain Madrid "
    "question answer number value function class return import python code file data "
    "write read test result error value list dict string integer float yes no please "
    "thank weather today tomorrow morning evening water fire earth air light dark "
    "red green blue black white house tree river mountain ocean book story computer"
).split()

_CODE_LINES = (
    "def {w}({a}):\n    return {a} + {n}\n",
    "for i in range({n}):\n    print(i, '{w}')\n",
    "class {W}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "if {a} == {n}:\n    {a} = {a} * 2\nelse:\n    {a} -= 1\n",
    "x = [{n}, {m}, {n}]  # {w}\n",
    '{{"{w}": {n}, "{a}": [{m}, "{W}"]}}\n',
)


def _corpus(seed: int = 1234, n_paragraphs: int = 1500) -> list[str]:
    """Deterministic training text: sentences, numbers, code, JSON, ChatML turns."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n_paragraphs):
        kind = rng.random()
        if kind < 0.55:
            sentences = []
            for _ in range(rng.randint(1, 4)):
                words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
                words[0] = words[0].capitalize()
                sentences.append(" ".join(words) + rng.choice(".?!,;:"))
            out.append(" ".join(sentences) + "\n")
        elif kind < 0.8:
            line = rng.choice(_CODE_LINES)
            w = rng.choice(_WORDS).lower()
            out.append(
                line.format(
                    w=w, W=w.capitalize(), a=rng.choice("abcxyz"),
                    n=rng.randint(0, 999), m=rng.randint(0, 99999),
                )
            )
        else:
            q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
            a = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 10)))
            out.append(
                f"<|im_start|>user\n{q}?<|im_end|>\n<|im_start|>assistant\n{a}.<|im_end|>\n"
            )
    return out


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Train the shared byte-level BPE tokenizer once per process; returns tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} exceeds {VOCAB_SIZE}")
    return str(tok.to_str())


def _tokenizer_config(tok: dict[str, Any], context_length: int = CONTEXT_LENGTH
                      ) -> dict[str, Any]:
    added = {
        str(t["id"]): {
            "content": t["content"], "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        }
        for t in tok["added_tokens"]
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": CHATML_TEMPLATE,
    }


def model_config(kind: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json of a tiny model of ``kind``."""
    common: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": CONTEXT_LENGTH,
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
        "torch_dtype": "float32",
    }
    if kind == "llama":
        return {
            **common,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    if kind == "scripted":
        return {
            **common,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "max_position_embeddings": LONG_CONTEXT_LENGTH,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    if kind == "gemma3_text":
        return {
            **common,
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 6,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 3,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        }
    if kind == "hybrid":
        return {
            **common,
            "model_type": "nemotron_h",
            "architectures": ["NemotronHForCausalLM"],
            "hybrid_override_pattern": ["M", "*", "M", "*"],
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "tie_word_embeddings": False,
        }
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")


def _seed_for(kind: str) -> int:
    return 1000 + KINDS.index(kind)


def new_model_folder(out_dir: str | os.PathLike[str]) -> tuple[Path, str, dict[str, int]]:
    """An empty model folder (created; ValueError if it holds anything), the shared
    tokenizer's JSON and its special tokens' ids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"output folder {out} is not empty")
    tok_text = tokenizer_json()
    tok = json.loads(tok_text)
    return out, tok_text, {t["content"]: int(t["id"]) for t in tok["added_tokens"]}


def build_tiny_model(kind: str, out_dir: str | os.PathLike[str]) -> Path:
    """Write a tiny random-weight model of ``kind`` into ``out_dir`` (created; must be empty)."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from promptcache.engine.mlx_compat import model_classes

    out, tok_text, special_ids = new_model_folder(out_dir)
    config = model_config(kind, special_ids)

    model_cls, args_cls = model_classes(config["model_type"])
    mx.random.seed(_seed_for(kind))
    model = model_cls(args_cls.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    if kind == "scripted":
        weights = _script_reply(weights, tok_text, special_ids[EOS_TOKEN])
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})

    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok_text)
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(json.loads(tok_text), int(config["max_position_embeddings"])),
                   indent=2)
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2) + "\n"
    )
    logger.info("built tiny %s model in %s (%d tensors)", kind, out, len(weights))
    return out


def _script_reply(weights: dict[str, Any], tok_text: str, eos_id: int) -> dict[str, Any]:
    """Set the "scripted" model's embedding and output rows (see the module docstring):
    newline -> reply token 1 -> ... -> last reply token -> EOS."""
    import mlx.core as mx
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_text)
    chain = [tok.token_to_id("Ċ"), *tok.encode(SCRIPTED_REPLY).ids]
    if len(set(chain)) != len(chain):
        raise RuntimeError("the scripted reply must not repeat a token")
    follows = chain[1:] + [eos_id]
    emb = np.array(weights["model.embed_tokens.weight"])
    head = np.array(weights["lm_head.weight"])
    k = len(chain)
    emb[:, :k] = 0.0
    head[:, :k] = 0.0
    for dim, (cur, nxt) in enumerate(zip(chain, follows, strict=True)):
        emb[cur, dim] = 50.0
        head[nxt, dim] = 8.0
    weights["model.embed_tokens.weight"] = mx.array(emb)
    weights["lm_head.weight"] = mx.array(head)
    return weights


def tiny_model_dirname(kind: str) -> str:
    return f"tiny-{kind}-v{TINY_MODELS_VERSION}"


def ensure_tiny_model(kind: str, cache_root: str | os.PathLike[str]) -> Path:
    """Return ``cache_root/tiny-<kind>-v<N>``, building it first if it does not exist.

    Built into a temporary folder next to it and renamed at the end, so a crash
    never leaves a half-built model under the final name; concurrent builders
    are harmless (the loser discards its copy).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    return ensure_built(Path(cache_root) / tiny_model_dirname(kind),
                        lambda tmp: build_tiny_model(kind, tmp))


def ensure_built(final: Path, build: Callable[[Path], object]) -> Path:
    """``final``, first built by ``build(tmp)`` into a temporary sibling folder and renamed.

    A folder counts as built when it has a ``config.json``. A crash never leaves a
    half-built model under the final name; concurrent builders are harmless (the loser
    discards its copy).
    """
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():  # not ours to trust: no config.json means it never finished
        logger.warning("removing incomplete model folder %s", final)
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.debug("model folder %s was built concurrently; using it", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
