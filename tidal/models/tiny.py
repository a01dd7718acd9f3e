"""Tiny random checkpoints in Hugging Face format, for tests and the embedded default model.

``make_tiny_checkpoint`` builds a seeded model with transformers' own config and model
class (``save_pretrained``), both named by the architecture's registry entry
(``tidal/models/registry.py``), plus a byte-level BPE tokenizer trained with the
``tokenizers`` library on a small built-in corpus, saved as a fast tokenizer with a
ChatML chat template. Same arguments -> byte-identical files.

``default_model_path()`` is the model ``launch`` serves without ``--model``: created once
under the user's cache directory and published with an atomic rename, so concurrent
processes never see a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from typing import Any

import torch

from tidal.kernels.fp8_torch import FP8_MAX, dequantize_fp8_blocks, quantize_fp8_blocks
from tidal.models.common import ModelEntry
from tidal.models.registry import entry_for_model_type, model_types
from tidal.utils.cache_dir import cache_root

ARCHS = tuple(model_types())
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Large enough that a random model's greedy continuation is not one token repeated.
DEFAULT_INIT_STD = 0.1

# The embedded default model (also the shape the benchmarks use).
DEFAULT_MODEL_ARGS: dict[str, Any] = {
    "arch": "qwen3_moe",
    "seed": 0,
    "hidden_size": 256,
    "num_layers": 4,
    "num_experts": 16,
    "top_k": 4,
    "vocab_size": 4096,
    "num_heads": 4,
    "num_kv_heads": 2,
    "moe_intermediate_size": 128,
    "max_position_embeddings": 2048,
    "norm_topk_prob": True,
}
_DEFAULT_VERSION = 1  # bump when the factory's output changes

_CORPUS = """\
The tide comes in twice a day and goes out twice a day.
A mixture of experts sends each token to a few of many small networks.
Hello, world! How are you today? I am fine, thank you.
Once upon a time there was a small boat on a wide blue sea.
The quick brown fox jumps over the lazy dog.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048.
User: What is the capital of France? Assistant: The capital of France is Paris.
def add(a, b): return a + b
"""
_SYLLABLES = (
    "ka to ri mo sen la ve qu zo pi na el an or is us th er ing ed st ch sh ow ai ou ee oo "
    "tide wave sea sand moon salt reef gull "
).split()


def make_tiny_checkpoint(
    path: str,
    arch: str = "qwen3_moe",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    norm_topk_prob: bool = True,
    dtype: str = "float32",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    moe_intermediate_size: int | None = None,
    intermediate_size: int | None = None,
    initializer_range: float = DEFAULT_INIT_STD,
    tie_word_embeddings: bool = False,
    init_device: str = "cpu",
    **config_overrides: Any,
) -> str:
    """Write a random ``arch`` checkpoint and tokenizer into ``path``; returns ``path``.

    ``arch`` is a registry ``model_type`` (``ARCHS``); the entry maps the expert counts
    and sizes to its config's fields. ``config_overrides`` go straight to the
    transformers config (e.g. ``mlp_only_layers``).
    ``init_device="cuda"`` draws the random weights on the GPU (seconds instead of minutes
    for billions of parameters; a different, equally seeded draw than on the CPU).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    entry = entry_for_model_type(arch)
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, max_position_embeddings)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "num_experts_per_tok": top_k,
        "initializer_range": initializer_range,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": None,
    }
    moe_inter = moe_intermediate_size or max(hidden_size // 2, 4)
    common.update(
        entry.tiny_config(
            num_experts, moe_inter, intermediate_size or 2 * hidden_size, norm_topk_prob
        )
    )
    config = _transformers_class(entry.hf_config_class)(**{**common, **config_overrides})
    model = _make_model(entry, config, seed, getattr(torch, dtype), init_device)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# The tiny FP8 checkpoints' sizes: a 256-wide hidden (two 128-wide blocks) and a 192-wide
# expert intermediate (one block and a partial one), so every block case is exercised.
FP8_TINY_ARGS: dict[str, Any] = {
    "hidden_size": 256,
    "moe_intermediate_size": 192,
    "intermediate_size": 320,
    "num_layers": 2,
    "num_experts": 8,
    "top_k": 2,
    "vocab_size": 512,
}


def make_tiny_fp8_checkpoint(
    path: str,
    arch: str = "deepseek_v3",
    *,
    block: tuple[int, int] | None = (128, 128),
    not_converted: tuple[str, ...] = (),
    seed: int = 0,
    source: str | None = None,
    **kwargs: Any,
) -> str:
    """A tiny checkpoint in the layout of DeepSeek-V3's FP8 release; returns ``path``.

    A seeded bfloat16 ``arch`` checkpoint (``make_tiny_checkpoint``, ``FP8_TINY_ARGS``
    unless ``kwargs`` say otherwise) whose projection weights (every ``*_proj.weight``:
    attention, dense MLPs, experts, shared experts; not the embeddings, norms, router or
    ``lm_head``) are quantized to ``float8_e4m3fn``: per ``block`` with a
    ``weight_scale_inv`` (``quantize_fp8_blocks``: amax / 448), or with ``block=None`` one
    per-tensor ``weight_scale``. Modules named in ``not_converted`` (name prefixes) stay
    bfloat16 and are listed in ``modules_to_not_convert``. config.json gets the
    ``quantization_config``. ``source``: quantize a copy of that tiny checkpoint instead
    of building one (``arch``, ``seed`` and ``kwargs`` unused)."""
    from safetensors.torch import load_file, save_file

    if source is None:
        make_tiny_checkpoint(path, arch, seed=seed, dtype="bfloat16", **{**FP8_TINY_ARGS, **kwargs})
    else:
        shutil.copytree(source, path)
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
        os.remove(os.path.join(path, name))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    out: dict[str, torch.Tensor] = {}
    for name, t in sorted(state.items()):
        keep = t.dim() != 2 or not name.endswith("_proj.weight")
        if keep or any(name.startswith(p) for p in not_converted):
            out[name] = t
        elif block is None:
            scale = (t.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
            out[name] = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[f"{name}_scale"] = scale.reshape(())
        else:
            out[name], out[f"{name}_scale_inv"] = quantize_fp8_blocks(t.float(), block)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        **({"weight_block_size": list(block)} if block is not None else {}),
        **({"modules_to_not_convert": list(not_converted)} if not_converted else {}),
    }
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return path


def dequantize_checkpoint(src: str, dst: str, dtype: str = "float32") -> str:
    """The FP8 checkpoint ``src`` dequantized into ``dst`` (every tensor in ``dtype``, no
    scales, no ``quantization_config``): the parity tests' reference, which transformers'
    model classes and Tidal both load as an ordinary checkpoint. Returns ``dst``."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    block = tuple(qc.get("weight_block_size") or (128, 128))
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, name)))
        elif name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))  # tokenizer files
    out: dict[str, torch.Tensor] = {}
    target = getattr(torch, dtype)
    for name, t in state.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = state.get(f"{name}_scale_inv", state.get(f"{name}_scale"))
            assert scale is not None, f"{name} has no scale"
            t = dequantize_fp8_blocks(t, scale, (int(block[0]), int(block[1])))
        out[name] = t.to(target)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return dst


def _transformers_class(name: str) -> Any:
    # transformers' model modules and tokenizers' trainers are imported here and below, not
    # at the top: only building a checkpoint needs them, and ``launch`` imports this module
    # for ``default_model_path``, which usually finds the checkpoint already built.
    # Importing a model class imports torch._dynamo, which makes inductor's cache folder
    # at once: under $TMPDIR by default, where nothing would remove it (a server building
    # the embedded model left it behind). Ours goes beside Tidal's other caches instead.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root(), "torchinductor"))
    import transformers

    return getattr(transformers, name)


def _make_model(
    entry: ModelEntry, config: Any, seed: int, dtype: Any, init_device: str = "cpu"
) -> Any:
    cls = _transformers_class(entry.hf_model_class)
    device = torch.device(init_device)
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), device:
        torch.manual_seed(seed)
        model = cls(config)
    if entry.tiny_init is not None:
        with torch.no_grad():
            entry.tiny_init(model, torch.Generator().manual_seed(seed))
    return model.to(dtype).eval()


def build_tokenizer(vocab_size: int, model_max_length: int) -> Any:
    """Byte-level BPE with exactly ``vocab_size`` ids (specials first: 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)}, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # corpus ran out of merges: fill with reserved ids so sizes match
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _corpus() -> list[str]:
    rng = random.Random(1234)  # fixed: the tokenizer does not depend on the model seed
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    lines = _CORPUS.splitlines()
    lines += [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(4000)]
    return lines


def default_model_path(cache_dir: str | None = None) -> str:
    """The embedded default model's folder, created on first use.

    ``cache_dir`` defaults to ``$XDG_CACHE_HOME/tidal`` or ``~/.cache/tidal``.
    """
    root = cache_dir or cache_root()
    key = json.dumps({**DEFAULT_MODEL_ARGS, "v": _DEFAULT_VERSION}, sort_keys=True)
    final = os.path.join(root, f"default-qwen3-moe-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        make_tiny_checkpoint(tmp, **DEFAULT_MODEL_ARGS)
        os.rename(tmp, final)  # atomic; fails if another process published first
    except OSError:
        if not os.path.isdir(final):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
