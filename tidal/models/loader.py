"""Build a model and fill it from a Hugging Face folder's ``*.safetensors`` files.

Files are read with plain file I/O (``SafetensorsFile``; a sharded checkpoint is found
through ``model.safetensors.index.json``), not memory-mapped: a mapped file's pages count
toward the process's resident memory until it is closed, and the 1024-wide model's load
peaked at 3.5 GB for 1.7 GB of weights. Only tensors this rank holds are read:
with ``local_expert_ids`` the other experts' tensors are recognised and skipped.

Checkpoint layouts: the per-expert names written by ``save_pretrained``
(``...experts.{e}.gate_proj.weight`` / Mixtral's ``...block_sparse_moe.experts.{e}.w1``)
and the fused 3-D names of transformers v5 modules (``...mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``...mlp.experts.down_proj`` ``[E, H, I]``), which are split per expert.

``load_experts=False`` (a joining engine under elastic EP) reads every tensor but the
experts' (their slots stay allocated, zero-filled: the weights arrive from peers);
``load_expert_weights`` reads given experts of given MoE layers on their own (the disk
fallback of an expert transfer).

A missing tensor, an unexpected tensor, or a shape mismatch raises ``CheckpointError``
naming the tensor(s).

Quantized checkpoints (``quantization_config``, docs/architecture.md#quantization): before
the CPU path trials, ``quantize_model`` converts the modules whose checkpoint weights are
stored quantized (FP8: ``float8_e4m3fn`` with a ``weight_scale_inv`` or ``weight_scale``)
to the method's held form -- ``Linear`` -> ``Fp8Linear``, MoE experts -> ``FusedMoE.hold_fp8``
-- and leaves the others (norms, embeddings, the router, ``lm_head``, a checkpoint's
``modules_to_not_convert``: stored unquantized) in the model's dtype. An FP8 tensor of a
module that cannot hold one (MLA's ``kv_b_proj``, read per head; ``lm_head``) is
dequantized as it is read. A missing scale, a scale of the wrong shape or a tensor of an
unexpected dtype is a ``CheckpointError`` naming the tensor and its file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.host_memory import release_free_heap
from tidal.kernels.select import SharedChoice, choose_paths
from tidal.layers.linear import Linear, RowParallelLinear
from tidal.layers.quant import Fp8Linear, QuantConfigError, QuantMethod, quant_method_from_config
from tidal.models.common import MoECausalLM, Shard
from tidal.models.registry import get_model_class
from tidal.moe.layer import FusedMoE, resolve_moe_backend

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that the runtime recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_GATE = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")
_MAX_NAMES = 10
# The CPU path trials' batch and prefill shape classes: decode steps of this many
# sequences, and steps of this many new tokens.
TRIAL_BATCH_ROWS = 32
TRIAL_PREFILL_ROWS = 256

Getter = Callable[[], Tensor]


class CheckpointError(ValueError):
    """The checkpoint does not match the model built from its config."""


def load_model(
    engine_config: Any,
    *,
    local_expert_ids: Sequence[int] | None = None,
    load_experts: bool = True,
    tp: TensorParallel | None = None,
    device: Any = None,
) -> MoECausalLM:
    """Model of ``engine_config.model`` in its dtype on ``device`` (default
    ``engine_config.device``), weights loaded. ``local_expert_ids``: the global experts
    this rank holds, in local slot order (None = all). ``load_experts=False``: the
    experts' slots are allocated (zeros) but not read from the checkpoint. ``tp``: this
    worker's shard (tensor parallelism); with ``enable_expert_parallel`` its experts are
    whole, else every expert's TP slice."""
    mc = engine_config.model
    cls = get_model_class(mc.architecture)
    model = cls(
        mc.hf_config,
        dtype=mc.torch_dtype,
        device=device if device is not None else engine_config.device,
        moe_backend=resolve_moe_backend(engine_config.moe_backend, engine_config.device),
        local_expert_ids=local_expert_ids,
        tp=tp,
        expert_parallel=engine_config.parallel.enable_expert_parallel,
    )
    config_file = os.path.join(mc.model, "config.json")
    try:
        quant = quant_method_from_config(mc.hf_config, config_file, mc.quantization)
    except QuantConfigError as e:
        raise CheckpointError(str(e)) from e
    if quant is not None:  # before the trials: they measure the held form's ops
        quantize_model(model, quant, checkpoint_index(mc.model))
    if engine_config.device == "cpu":
        # Before the weights: the trials run on stand-ins of the model's shapes, and the
        # loader then packs each weight straight into the chosen path's layout (one copy).
        model.cpu_paths = choose_paths(
            model.modules(),
            mode=engine_config.cpu_kernels,
            cache_dir=engine_config.kernel_cache_dir,
            batch_rows=min(TRIAL_BATCH_ROWS, engine_config.scheduler.max_num_seqs),
            prefill_rows=min(TRIAL_PREFILL_ROWS, engine_config.scheduler.max_num_batched_tokens),
            dtype=mc.torch_dtype,
            share=_tp_shared_choice(tp),
        )
        release_free_heap()  # the trials' stand-ins: freed, but kept resident by the heap
    load_weights(model, mc.model, load_experts=load_experts)
    return model.eval()


def _tp_shared_choice(tp: TensorParallel | None) -> SharedChoice | None:
    """A rank's TP workers serve by one choice, TP rank 0's (``SharedChoice`` says why);
    their shards have equal shapes, so its trials ran on every worker's shapes."""
    if tp is None or tp.size == 1:
        return None

    def exchange(doc: dict[str, Any] | None) -> dict[str, Any]:
        return tp.group.all_gather_object(doc)[0]

    return SharedChoice(tp.is_driver, exchange, "TP rank 0")


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointError(
                f"{INDEX_FILE} in {folder} lists missing file(s): {', '.join(missing)}"
            )
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return [os.path.join(folder, n) for n in names]


@torch.no_grad()
def load_weights(model: MoECausalLM, folder: str, *, load_experts: bool = True) -> None:
    targets: dict[str, Target] = dict(model.weight_targets())
    if not load_experts:
        # Known names still (so nothing is "unexpected" or "missing"), nothing read.
        targets.update(dict.fromkeys(_expert_targets(model, biases=model.spec.expert_bias), None))
        for moe in model.moe_layers():
            for name in moe.expert_part_names():  # not packed yet: ordinary parameters
                getattr(moe, name).zero_()
    if model.quant is not None:
        targets = quant_targets(model.quant, targets, checkpoint_index(folder), _held_fp8(model))
    seen: set[str] = set()
    unexpected: list[str] = []
    dest: Target = None
    for path in safetensors_files(folder):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                for vname, get in _expand(name, f, model):
                    if vname not in targets:
                        ignored = vname.endswith(_IGNORED_SUFFIXES) or model.ignores_weight(vname)
                        if not ignored:
                            unexpected.append(vname)
                        continue
                    seen.add(vname)
                    dest = targets[vname]
                    if dest is not None:
                        _write(vname, path, get(), dest)
    optional = model.optional_weight_names()
    missing = [n for n in targets if n not in seen and n not in optional]
    # The views of every parameter go before the packing: a parameter a packed path
    # releases is then freed as its pack is made, so the weights are never held twice.
    del targets, dest
    # The chosen CPU paths' packed layouts are built now, not by the first step:
    # that costs ~1 s on the 1024-wide model, which belongs to start-up (and to the memory
    # measured before the KV cache is sized), not to the first request. A packed layout is
    # the weight's only copy from then on (tidal/kernels/cpu_paths.py). Experts that were
    # not read (a joining engine: they arrive from peers) are packed when they are written.
    for module in model.modules():
        pack = getattr(module, "pack_weights", None)
        if pack is not None and (load_experts or not isinstance(module, FusedMoE)):
            pack()
    if missing or unexpected:
        raise CheckpointError(_mismatch_message(type(model).__name__, folder, missing, unexpected))


def _expert_targets(
    model: MoECausalLM,
    experts: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    biases: bool = False,
) -> dict[str, tuple[int, int, str]]:
    """Checkpoint name -> (decoder layer index, logical expert, "gate" | "up" | "down",
    or with ``biases`` also "gate_bias" | "up_bias" | "down_bias") of the per-expert
    tensors of ``experts`` (None: all) in MoE layers ``layers`` (decoder layer indices;
    None: every MoE layer)."""
    n = model.names
    out: dict[str, tuple[int, int, str]] = {}
    for i, layer in enumerate(model.decoder_layers):
        moe = layer.mlp
        if not isinstance(moe, FusedMoE) or (layers is not None and i not in layers):
            continue
        ids = range(moe.num_experts) if experts is None else experts
        for e in ids:
            base = f"model.layers.{i}.{n.moe_module}.experts.{e}"
            out[f"{base}.{n.expert_gate}.weight"] = (i, e, "gate")
            out[f"{base}.{n.expert_up}.weight"] = (i, e, "up")
            out[f"{base}.{n.expert_down}.weight"] = (i, e, "down")
            if biases:
                out[f"{base}.{n.expert_gate}.bias"] = (i, e, "gate_bias")
                out[f"{base}.{n.expert_up}.bias"] = (i, e, "up_bias")
                out[f"{base}.{n.expert_down}.bias"] = (i, e, "down_bias")
    return out


@torch.no_grad()
def load_expert_weights(
    model: MoECausalLM, folder: str, wanted: Mapping[int, Sequence[int]]
) -> dict[tuple[int, int], tuple[Tensor, ...]]:
    """Read from the checkpoint only the experts ``wanted`` (decoder layer index -> logical
    expert ids) of ``model``'s architecture: ``{(layer, expert): (w13 [2I, H], w2 [H, I])}``,
    CPU tensors in the model's dtype (gate rows, then up rows, as ``FusedMoE.w13``); FP8
    experts add their row scales (``FusedMoE.expert_part_specs``: ``(w13, w2, w13_scale,
    w2_scale)``), biased experts (GPT-OSS) their biases (``(w13, w2, w13_bias [2I],
    w2_bias [H])``). CheckpointError when one of them is not in the checkpoint."""
    names: dict[str, tuple[int, int, str]] = {}
    biases = model.spec.expert_bias
    for layer, experts in wanted.items():
        if experts:
            names.update(_expert_targets(model, list(experts), [layer], biases))
    if not names:
        return {}
    inter = model.spec.moe_intermediate_size
    specs = model.moe_layers()[0].expert_part_specs()
    out: dict[tuple[int, int], tuple[Tensor, ...]] = {}
    for layer, e, _ in names.values():
        if (layer, e) not in out:
            out[layer, e] = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in specs)
    targets: dict[str, Target] = {}
    for name, (layer, e, part) in names.items():
        parts = out[layer, e]
        # The biases are the last two parts (expert_part_specs), gate rows then up rows.
        w13, w2, b13, b2 = *parts[:2], *parts[-2:]
        views = {"gate": w13[:inter], "up": w13[inter:], "down": w2}
        if biases:
            views.update(gate_bias=b13[:inter], up_bias=b13[inter:], down_bias=b2)
        targets[name] = views[part]
    if model.quant is not None:
        held = {
            _storage(w): (w, scale)
            for parts in out.values()
            for w, scale in ((parts[0], parts[2]), (parts[1], parts[3]))
        }
        targets = quant_targets(model.quant, targets, checkpoint_index(folder), held)
    seen: set[str] = set()
    for path in safetensors_files(folder):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if ".experts" not in name:
                    continue
                for vname, get in _expand(name, f, model):
                    dest = targets.get(vname)
                    if dest is None:
                        continue
                    _write(vname, path, get(), dest)
                    seen.add(vname)
    missing = [n for n, t in targets.items() if n not in seen and t is not None]
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks expert tensor(s): {_some(missing)}")
    return out


# safetensors' dtype names (its format: little-endian, as this reader assumes).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class SafetensorsFile:
    """One ``*.safetensors`` file, its tensors read with ``readinto`` into fresh tensors
    (the part of ``safetensors.safe_open``'s interface the loader uses: ``keys()``,
    ``get_tensor(name)``, ``get_slice(name).get_shape()``). Nothing is memory-mapped, so
    what was read is resident only as the copy the caller keeps."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close() / the with block
        try:
            size = int.from_bytes(self._file.read(8), "little")
            header = json.loads(self._file.read(size))
        except (ValueError, OSError) as e:
            self._file.close()
            raise CheckpointError(f"{path} is not a safetensors file: {e}") from e
        header.pop("__metadata__", None)
        self._header: dict[str, dict[str, Any]] = header
        self._base = 8 + size

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, name: str) -> _TensorInfo:
        return _TensorInfo(tuple(self._header[name]["shape"]))

    def dtype_name(self, name: str) -> str:
        """The stored dtype, as safetensors names it (``F8_E4M3``, ``BF16``...)."""
        return str(self._header[name]["dtype"])

    def get_tensor(self, name: str) -> Tensor:
        info = self._header[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {self.path}: dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=dtype)
        raw = out.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes != end - start:
            raise CheckpointError(f"tensor {name!r} in {self.path}: size does not match shape")
        self._file.seek(self._base + start)
        if self._file.readinto(memoryview(raw)) != raw.nbytes:  # pyright: ignore[reportArgumentType]
            raise CheckpointError(f"tensor {name!r} in {self.path}: file truncated")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TensorInfo:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self._shape = shape

    def get_shape(self) -> list[int]:
        return list(self._shape)


def _copy(name: str, file: str, src: Tensor, dest: Tensor | Shard) -> None:
    if isinstance(dest, Shard):  # this worker's block (tensor parallelism)
        size = dest.dest.shape[dest.dim]
        if src.dim() != dest.dest.dim() or src.shape[dest.dim] < dest.start + size:
            raise CheckpointError(
                f"tensor {name!r} in {file} has shape {tuple(src.shape)}, too small for "
                f"block [{dest.start}, {dest.start + size}) of dim {dest.dim}"
            )
        src, dest = src.narrow(dest.dim, dest.start, size), dest.dest
    if tuple(src.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"tensor {name!r} in {file} has shape {tuple(src.shape)}, "
            f"but the model expects {tuple(dest.shape)}"
        )
    if src.dtype != dest.dtype and (src.dtype in _FP8 or dest.dtype in _FP8):
        # A float8 value is only meaningful with its scale: never converted silently.
        raise CheckpointError(
            f"tensor {name!r} in {file} has dtype {src.dtype}, but the model holds it as "
            f"{dest.dtype}"
            + (" (no quantization_config in config.json)" if src.dtype in _FP8 else "")
        )
    dest.copy_(src)


def _expand(name: str, f: Any, model: MoECausalLM) -> Iterator[tuple[str, Getter]]:
    """Yield (checkpoint-layout name, lazy tensor) pairs for one stored tensor; fused 3-D
    expert tensors become one pair per expert (read once, only if a local expert asks)."""
    custom = model.expand_tensor(
        name, lambda: f.get_tensor(name), tuple(f.get_slice(name).get_shape())
    )
    if custom is not None:  # an architecture's own layout (GPT-OSS)
        yield from custom
        return
    names = model.names
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        m_gate = _FUSED_GATE.match(name)  # v5 names Mixtral's router mlp.gate too
        alias = f"{m_gate.group(1)}.{names.moe_module}.gate.weight" if m_gate else name
        yield alias, lambda: f.get_tensor(name)
        return
    prefix, kind = m.group(1), m.group(2)
    cache: dict[str, Tensor] = {}

    def whole() -> Tensor:
        if "t" not in cache:
            cache["t"] = f.get_tensor(m.group(0))
        return cache["t"]

    num_experts = f.get_slice(m.group(0)).get_shape()[0]
    base = f"{prefix}.{names.moe_module}.experts"
    for e in range(num_experts):
        if kind == "down_proj":
            yield f"{base}.{e}.{names.expert_down}.weight", lambda e=e: whole()[e]
        else:
            yield f"{base}.{e}.{names.expert_gate}.weight", lambda e=e: _half(whole()[e], 0)
            yield f"{base}.{e}.{names.expert_up}.weight", lambda e=e: _half(whole()[e], 1)


def _half(t: Tensor, i: int) -> Tensor:  # [2I, H] -> gate (i=0) or up (i=1) rows
    return t.chunk(2, dim=0)[i]


def _mismatch_message(cls: str, folder: str, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"checkpoint {folder} does not match {cls}:"]
    if missing:
        parts.append(f"missing {len(missing)} tensor(s): {_some(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} tensor(s): {_some(unexpected)}")
    return " ".join(parts)


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    return shown + (f", ... ({len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else "")


# ---------------------------------------------------------------------- quantized checkpoints

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor as its file's header describes it."""

    file: str  # the path
    dtype: str  # safetensors' name (``F8_E4M3``, ``BF16``...)
    shape: tuple[int, ...]


def checkpoint_index(folder: str) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint in ``folder``, from the files' headers (no data read)."""
    index: dict[str, StoredTensor] = {}
    for path in safetensors_files(folder):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                index[name] = StoredTensor(path, f.dtype_name(name), shape)
    return index


@dataclass(frozen=True)
class _Scales:
    """Loader target: the held row scales of (a row block of) an FP8 weight, filled from
    the weight's checkpoint scale (``tidal/kernels/fp8_torch.py``'s ``row_scales``)."""

    dest: Tensor  # [rows, ceil(cols / bk)] float32
    weight: str  # the weight's checkpoint name
    rows: int  # the checkpoint weight's shape
    cols: int
    method: QuantMethod
    shard: tuple[int, int, int] | None = None  # TP: (dim, start, size) of the weight held


@dataclass(frozen=True)
class _Dequantized:
    """Loader target: an FP8 checkpoint tensor its module holds in the model's dtype,
    dequantized as it is read (its scale read beside it)."""

    dest: Tensor | Shard
    method: QuantMethod
    scale: StoredTensor
    scale_name: str


Target = Tensor | Shard | _Scales | _Dequantized | None


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held_fp8(model: MoECausalLM) -> dict[int, tuple[Tensor, Tensor]]:
    """The model's FP8 weights and their row scales, by the weight's storage (a loader
    target is a view of one of them)."""
    held: dict[int, tuple[Tensor, Tensor]] = {}
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            held[_storage(module.weight)] = (module.weight.data, module.weight_scale)
    for moe in model.moe_layers():
        if moe.w13_scale is not None and moe.w2_scale is not None:
            held[_storage(moe.w13)] = (moe.w13.data, moe.w13_scale)
            held[_storage(moe.w2)] = (moe.w2.data, moe.w2_scale)
    return held


def _row_block(weight: Tensor, view: Tensor) -> tuple[int, int]:
    """(first row, rows) of contiguous ``weight [..., N, K]`` that ``view`` covers: a view
    of whole rows, as every loader target of a held FP8 weight is."""
    k = weight.shape[-1]
    offset = view.storage_offset() - weight.storage_offset()
    if not (weight.is_contiguous() and view.is_contiguous() and view.shape[-1] == k):
        raise AssertionError(f"a loader target of an FP8 weight is not whole rows: {view.shape}")
    if offset % k:
        raise AssertionError("a loader target of an FP8 weight starts inside a row")
    return offset // k, view.numel() // k


@torch.no_grad()
def quantize_model(
    model: MoECausalLM, method: QuantMethod, index: Mapping[str, StoredTensor]
) -> None:
    """Convert the modules whose checkpoint weights are stored quantized (``index``) to
    ``method``'s held form, uninitialised (the loader fills them). One module holding
    several checkpoint tensors (q|k|v, gate|up) must have all or none quantized."""
    quantized = _dtype_name(method.weight_dtype)
    owners: dict[int, tuple[str, Any]] = {}  # weight storage -> (module name, module)
    for qualname, module in model.named_modules():
        if isinstance(module, Linear) and module is not model.lm_head:
            owners[_storage(module.weight)] = (qualname, module)
    for moe in model.moe_layers():
        owners[_storage(moe.w13)] = owners[_storage(moe.w2)] = ("", moe)
    stored: dict[int, dict[bool, str]] = {}  # owner -> {is quantized: a tensor's name}
    for name, dest in model.weight_targets().items():
        tensor = dest.dest if isinstance(dest, Shard) else dest
        entry = index.get(name)
        if tensor is None or entry is None or _storage(tensor) not in owners:
            continue
        stored.setdefault(_storage(tensor), {})[entry.dtype == quantized] = name
        if isinstance(dest, Shard) and entry.dtype == quantized:  # TP workers' blocks
            # Every worker's block, not only this one's: all workers refuse alike.
            size = dest.dest.shape[dest.dim]
            try:
                for start in range(0, entry.shape[dest.dim], size):
                    method.check_split(dest.dim, start, size)
            except ValueError as e:
                raise CheckpointError(
                    f"--tensor-parallel-size {model.tp.size}: tensor {name!r} "
                    f"{list(entry.shape)} in {os.path.basename(entry.file)} cannot be split: {e}"
                ) from e
    converted: set[int] = set()
    for key, kinds in stored.items():
        if True not in kinds:
            continue
        if False in kinds:
            q, plain = kinds[True], kinds[False]
            q_file, plain_file = (os.path.basename(index[n].file) for n in (q, plain))
            raise CheckpointError(
                f"tensor {q!r} in {q_file} is {method.weight_dtype} but {plain!r} "
                f"({index[plain].dtype} in {plain_file}), which one module holds with it, "
                "is not quantized"
            )
        qualname, module = owners[key]
        if id(module) in converted:
            continue
        converted.add(id(module))
        if isinstance(module, Linear):
            parent_name, _, attr = qualname.rpartition(".")
            parent = model.get_submodule(parent_name)
            tp = module.tp if isinstance(module, RowParallelLinear) else None
            setattr(parent, attr, method.make_linear(module, tp))
        else:
            method.hold_experts(module)
    model.quant = method


def quant_targets(
    method: QuantMethod,
    targets: Mapping[str, Target],
    index: Mapping[str, StoredTensor],
    held: Mapping[int, tuple[Tensor, Tensor]],
) -> dict[str, Target]:
    """``targets`` plus the scales of its quantized tensors: into the held row scales of
    the FP8 weights of ``held`` (weight storage -> (weight, scales)), or, for a tensor
    held unquantized, read with it to dequantize it (``_Dequantized``)."""
    quantized = _dtype_name(method.weight_dtype)
    out = dict(targets)
    for name, dest in targets.items():
        entry = index.get(name)
        if entry is None or isinstance(dest, _Scales | _Dequantized):
            continue
        options = method.scale_names(name)
        if entry.dtype != quantized:
            scale = next((n for n in options if n in index), None)
            if scale is not None:  # scaled, so meant quantized, but of another dtype
                raise CheckpointError(
                    f"tensor {name!r} in {os.path.basename(entry.file)} has scale {scale!r} "
                    f"but dtype {_DTYPES.get(entry.dtype, entry.dtype)}, not "
                    f"{method.weight_dtype}"
                )
            continue
        scale_name = next((n for n in options if n in index), None)
        if scale_name is None:
            where = os.path.basename(entry.file)
            raise CheckpointError(
                f"tensor {name!r} in {where} is {method.weight_dtype} but the checkpoint has "
                f"no scale for it ({' or '.join(options)})"
            )
        if dest is None:  # known, not this rank's
            out[scale_name] = None
            continue
        tensor = dest.dest if isinstance(dest, Shard) else dest
        pair = held.get(_storage(tensor))
        if pair is None:  # held in the model's dtype (MLA's kv_b_proj, lm_head)
            out[name] = _Dequantized(dest, method, index[scale_name], scale_name)
            out[scale_name] = None  # read by the _Dequantized target
            continue
        assert len(entry.shape) == 2, name
        weight, scales = pair
        first, rows = _row_block(weight, tensor)
        view = scales.view(-1, scales.shape[-1])[first : first + rows]
        # A TP worker's block (quantize_model checked that it splits on scale blocks)
        shard = None if isinstance(dest, Tensor) else (dest.dim, dest.start, tensor.shape[dest.dim])
        out[scale_name] = _Scales(view, name, entry.shape[0], entry.shape[1], method, shard)
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


def _write(name: str, path: str, src: Tensor, dest: Target) -> None:
    """Fill loader target ``dest`` with checkpoint tensor ``name`` of file ``path``."""
    file = os.path.basename(path)
    if isinstance(dest, _Scales):
        if not src.is_floating_point() or src.dtype in _FP8:
            raise CheckpointError(f"tensor {name!r} in {file}: a scale of dtype {src.dtype}")
        try:
            rows = dest.method.held_scales(src, dest.rows, dest.cols)
            if dest.shard is not None:
                rows = dest.method.shard_scales(rows, *dest.shard)
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} in {file} (of {dest.weight!r}): {e}") from e
        _copy(name, file, rows, dest.dest)
    elif isinstance(dest, _Dequantized):
        if src.dtype != dest.method.weight_dtype:
            raise CheckpointError(f"tensor {name!r} in {file}: dtype {src.dtype}")
        with SafetensorsFile(dest.scale.file) as f:
            scale = f.get_tensor(dest.scale_name)
        try:
            scales = dest.method.held_scales(scale, src.shape[0], src.shape[-1])
        except ValueError as e:
            where = os.path.basename(dest.scale.file)
            raise CheckpointError(f"tensor {dest.scale_name!r} in {where}: {e}") from e
        out_dtype = (dest.dest.dest if isinstance(dest.dest, Shard) else dest.dest).dtype
        _copy(name, file, dest.method.dequantize(src, scales, out_dtype), dest.dest)
    elif dest is not None:
        _copy(name, file, src, dest)
