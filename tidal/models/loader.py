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
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tidal.distributed.tensor_parallel import TensorParallel
from tidal.kernels.host_memory import release_free_heap
from tidal.kernels.select import SharedChoice, choose_paths
from tidal.models.common import MoECausalLM, Shard
from tidal.models.registry import get_model_class
from tidal.moe.layer import FusedMoE, resolve_moe_backend

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that the runtime recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_GATE = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")
_MAX_NAMES = 10
# The batch shape class of the CPU path trials: decode steps of this many sequences.
TRIAL_BATCH_ROWS = 32

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
    if engine_config.device == "cpu":
        # Before the weights: the trials run on stand-ins of the model's shapes, and the
        # loader then packs each weight straight into the chosen path's layout (one copy).
        model.cpu_paths = choose_paths(
            model.modules(),
            mode=engine_config.cpu_kernels,
            cache_dir=engine_config.kernel_cache_dir,
            batch_rows=min(TRIAL_BATCH_ROWS, engine_config.scheduler.max_num_seqs),
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
    targets = model.weight_targets()
    if not load_experts:
        # Known names still (so nothing is "unexpected" or "missing"), nothing read.
        targets.update(dict.fromkeys(_expert_targets(model), None))
        for moe in model.moe_layers():
            moe.w13.data.zero_()
            moe.w2.data.zero_()
    seen: set[str] = set()
    unexpected: list[str] = []
    dest: Tensor | Shard | None = None
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
                        _copy(vname, os.path.basename(path), get(), dest)
    optional = model.optional_weight_names()
    missing = [n for n in targets if n not in seen and n not in optional]
    # The views of every parameter go before the packing: a parameter a packed path
    # releases is then freed as its pack is made, so the weights are never held twice.
    del targets, dest
    for module in model.modules():  # weights written through rebuilt parameters: re-packed
        updated = getattr(module, "weights_updated", None)
        if updated is not None:
            updated()
    # ... and the chosen CPU paths' packed layouts are built now, not by the first step:
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
    model: MoECausalLM, experts: Sequence[int] | None = None, layers: Sequence[int] | None = None
) -> dict[str, tuple[int, int, str]]:
    """Checkpoint name -> (decoder layer index, logical expert, "gate" | "up" | "down") of
    the per-expert tensors of ``experts`` (None: all) in MoE layers ``layers`` (decoder
    layer indices; None: every MoE layer)."""
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
    return out


@torch.no_grad()
def load_expert_weights(
    model: MoECausalLM, folder: str, wanted: Mapping[int, Sequence[int]]
) -> dict[tuple[int, int], tuple[Tensor, Tensor]]:
    """Read from the checkpoint only the experts ``wanted`` (decoder layer index -> logical
    expert ids) of ``model``'s architecture: ``{(layer, expert): (w13 [2I, H], w2 [H, I])}``,
    CPU tensors in the model's dtype (gate rows, then up rows, as ``FusedMoE.w13``).
    CheckpointError when one of them is not in the checkpoint."""
    names: dict[str, tuple[int, int, str]] = {}
    for layer, experts in wanted.items():
        if experts:
            names.update(_expert_targets(model, list(experts), [layer]))
    if not names:
        return {}
    spec = model.spec
    inter, hidden = spec.moe_intermediate_size, spec.hidden_size
    dtype = model.moe_layers()[0].params_dtype
    out: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    for layer, e, _ in names.values():
        if (layer, e) not in out:
            out[layer, e] = (
                torch.empty((2 * inter, hidden), dtype=dtype),
                torch.empty((hidden, inter), dtype=dtype),
            )
    seen: set[str] = set()
    for path in safetensors_files(folder):
        with SafetensorsFile(path) as f:
            for name in f.keys():
                if ".experts" not in name:
                    continue
                for vname, get in _expand(name, f, model):
                    where = names.get(vname)
                    if where is None:
                        continue
                    layer, e, part = where
                    w13, w2 = out[layer, e]
                    dest = {"gate": w13[:inter], "up": w13[inter:], "down": w2}[part]
                    _copy(vname, os.path.basename(path), get(), dest)
                    seen.add(vname)
    missing = [n for n in names if n not in seen]
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
