"""Open a GGUF model: check its architecture, read hyper-parameters, decide where every
tensor lives (``-ngl``), and load the weights into those devices' buffers."""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pyggml import Tensor
from pyggml.backend import Buffer, Device, DeviceType
from pyggml.gguf import GGUFError, GGUFFile

from . import gemma3, gpt_oss, llama, qwen2, qwen3, qwen3moe
from pyggml.batch_rules import BatchRules

from .architecture import Architecture
from .hparams import HParams
from .placement import MiB, Placement, PlacementError, Sizes, describe, parse_ngl, parse_split, plan_auto
from .tensor_split import FileSlice, Shard, SplitError, plan_tensor_split, shard_rows, shard_tensor

log = logging.getLogger("pyggml.models")

ARCHITECTURES: dict[str, Architecture] = {m.ARCHITECTURE.name: m.ARCHITECTURE
                                          for m in (llama, qwen2, qwen3, qwen3moe, gemma3, gpt_oss)}


class UnsupportedArchitecture(GGUFError):
    pass


@dataclass
class LoadedModel:
    """Weights in device buffers plus what is needed to build graphs (llama_model)."""
    path: Path
    gguf: GGUFFile
    hp: HParams
    arch: Architecture
    devices: list[Device]
    placement: Placement
    weights: dict[str, Tensor] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)
    # split mode "tensor": each device's share of every layer, and its weights (the first's
    # are ``weights``: it holds the embedding and the head too); None: layers split whole
    shards: list[Shard] | None = None
    shard_weights: list[dict[str, Tensor]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.gguf.get("general.name", self.path.stem))

    def used_devices(self) -> list[int]:
        """The device ids that hold some of the model (the CPU included where it does)."""
        return sorted({*self.placement.used(), *(s.device for s in self.shards or [])})

    @property
    def batch_rules(self) -> BatchRules:
        """The batch widths every device holding the model computes by (pyggml.batch_rules),
        for the weights a prompt's every token meets: the layers' (not the head's, which
        multiplies the outputs alone)."""
        products = {w.type for name, w in self.weights.items() if name.startswith("blk.") and w.ne[1] > 1}
        rules = [self.devices[i].batch_rules(products) for i in self.used_devices()]
        try:
            return functools.reduce(BatchRules.joined, rules)
        except ValueError as e:
            raise PlacementError(f"the devices compute with different batch rules: {e}") from None

    def layer_device(self, il: int) -> Device:
        return self.devices[self.placement.layers[il]]

    def weights_nbytes(self) -> int:
        return sum(t.nbytes() for t in self.weights.values())

    def free(self) -> None:
        for buf in self.buffers:
            buf.free()
        self.buffers = []


def default_devices() -> list[Device]:
    """Local devices in id order: GPUs first, the CPU last (RPC endpoints go before both)."""
    import pyggml
    devs = pyggml.devices()
    return [d for d in devs if d.get_type() != DeviceType.CPU] + [pyggml.cpu_device()]


_opened: dict[tuple[str, int, int], GGUFFile] = {}


def _open_cached(path: str | os.PathLike) -> GGUFFile:
    """A parsed GGUF, reused while the file is unchanged: parsing a large vocabulary takes
    seconds, and a process that loads the same model again (another placement, a reload
    onto RPC servers) should not pay that twice.  Two files are kept at most."""
    p = Path(path)
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return GGUFFile(path)  # let GGUFFile word the error
    f = _opened.get(key)
    if f is None:
        f = GGUFFile(path)
        if len(_opened) >= 2:
            _opened.pop(next(iter(_opened)))
        _opened[key] = f
    return f


def open_gguf(path: str | os.PathLike) -> tuple[GGUFFile, Architecture]:
    f = _open_cached(path)
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(f.path, f"unsupported architecture {arch!r}; supported: "
                                              f"{', '.join(sorted(ARCHITECTURES))}")
    return f, ARCHITECTURES[arch]


def model_sizes(f: GGUFFile, hp: HParams, n_ctx: int, n_ubatch: int) -> Sizes:
    """What each part of the model in ``f`` needs on its device (for -ngl auto)."""
    layer = [0] * hp.n_layer
    prolog = epilog = 0
    for name in f.tensors:
        size = f.new_tensor(name).nbytes()
        if name.startswith("blk."):
            layer[int(name.split(".", 2)[1])] += size
        elif name.startswith("token_embd"):
            prolog += size
        else:
            epilog += size
    tied = f.new_tensor("token_embd.weight").nbytes() if "output.weight" not in f.tensors else 0
    kv = n_ctx * (hp.n_embd_k_gqa + hp.n_embd_v_gqa) * 2  # F16 keys and values
    # activations of one ubatch (a few rows of n_embd and n_ff), float32, as the allocator reuses them
    compute = n_ubatch * (6 * hp.n_embd + 3 * hp.n_ff) * 4
    return Sizes(layer, [kv] * hp.n_layer, prolog, epilog, tied, compute, n_ubatch * hp.n_vocab * 4)


def device_speeds(devices: list[Device]) -> list[float] | None:
    """Each device's GB/s through products (pyggml.speed): an RPC server's as it measured it,
    a local GPU's measured now (once per process); None unless every one is known."""
    speeds = []
    for d in devices:
        speed = d.get_speed()
        if speed is None and d.connection() is None and d.get_type() != DeviceType.CPU:  # a local GPU
            speed = _local_speed.get(d.get_name())
            if speed is None:
                from pyggml.speed import measure
                speed = _local_speed[d.get_name()] = measure(d)
        speeds.append(float(speed or 0.0))
    return speeds if speeds and all(s > 0 for s in speeds) else None


_local_speed: dict[str, float] = {}


def plan(f: GGUFFile, hp: HParams, ngl: str | int | None, devices: list[Device], n_ctx: int = 2048,
         n_ubatch: int = 256, tensor_split: str | None = None, place_by: str = "speed") -> tuple[Placement, str]:
    """The placement (``-ngl``; ``auto`` spreads layers by the devices' measured speed, or by
    free memory with ``place_by`` "memory" or a speed unknown; ``-ts`` by the given
    proportions) and its description, one row per device used."""
    names = [d.get_name() for d in devices]
    sizes = model_sizes(f, hp, n_ctx, n_ubatch)
    free = [d.get_memory()[0] for d in devices]
    measured = None
    if str(ngl).strip().lower() == "auto" or tensor_split is not None:
        if ngl is not None and str(ngl).strip().lower() not in ("auto", "all", "-1"):
            raise PlacementError(f"-ts/--tensor-split spreads every layer; it cannot be combined with -ngl {ngl}")
        if place_by not in PLACE_BY:
            raise PlacementError(f"placement by {place_by!r}: choose one of {', '.join(PLACE_BY)}")
        speeds = device_speeds(devices[:-1]) if place_by == "speed" and tensor_split is None else None
        if speeds:
            measured = [f"{s:.1f} GB/s" + (f", {1e3 * d.connection().rtt:.2f} ms round trip"
                                            if d.connection() is not None else "") for s, d in zip(speeds, devices)]
        placement = plan_auto(sizes, names, free, parse_split(tensor_split, len(devices) - 1), speeds)
    else:
        placement = parse_ngl(ngl, hp.n_layer, names)
        spec = str(ngl).strip().lower()
        if len(devices) == 1 and (spec in ("all", "-1") or spec.isdigit() and int(spec) > 0):
            log.warning("-ngl %s: there is no GPU here and no --rpc server; every layer runs on the CPU", ngl)
    return placement, describe(placement, sizes, names, free, measured)


SPLIT_MODES = ("layer", "tensor", "auto")
PLACE_BY = ("speed", "memory")  # what -ngl auto spreads layers by

# split mode "auto": tensor when each CPU device's share of a layer's weights is at least this
# much.  A tensor split pays a layer's four exchanges (~0.7 ms between two one-core servers on
# one host: bench/scale.py) to halve its compute; a one-core server reads about 3 GB/s of Q4_0
# weights, so below a few MiB per share the exchanges cost more than they save - SmolLM2 (about
# 2 MiB a share) decodes at 0.4x one server, a 1B llama (17 MiB a share) faster than one.
AUTO_TENSOR_SHARE_BYTES = 8 * MiB


def choose_split_mode(f: GGUFFile, hp: HParams, ngl: str | int | None, devices: list[Device],
                      tensor_split: str | None) -> tuple[str, str]:
    """Split mode "auto": "tensor" where every layer is large enough to be worth dividing
    among the devices before the CPU (AUTO_TENSOR_SHARE_BYTES), else "layer"; and why.  Never
    tensor on GPUs (a layer's compute there takes less than one exchange) or with -ngl N.  Of a
    mixture of experts, what a token reads counts: its experts' share of the stacks."""
    candidates = devices[:-1]
    share = parse_split(tensor_split, len(candidates)) if candidates else None
    n = len([w for w in share if w > 0]) if share else len(candidates)
    used = hp.n_expert_used / hp.n_expert if hp.n_expert else 1.0
    layer_bytes = sum(f.new_tensor(name).nbytes() * (used if "_exps." in name else 1.0)
                      for name in f.tensors if name.startswith("blk.0."))
    each = layer_bytes / max(n, 1)
    if n < 2:
        return "layer", "split mode auto: layer (fewer than two devices to divide a layer among)"
    if ngl is not None and str(ngl).strip().lower() not in ("auto", "all", "-1"):
        return "layer", f"split mode auto: layer (-ngl {ngl} places layers)"
    if any(d.get_type() != DeviceType.CPU for d in candidates):
        return "layer", "split mode auto: layer (on GPUs a layer's compute takes less than its exchanges)"
    if each < AUTO_TENSOR_SHARE_BYTES:
        return "layer", (f"split mode auto: layer (each device's share of a layer, {each / MiB:.1f} MiB, is under "
                         f"{AUTO_TENSOR_SHARE_BYTES / MiB:.0f} MiB: its exchanges would cost more than they save)")
    try:
        plan_tensor_split(hp, list(range(n)), [1.0] * n)
    except SplitError as e:
        return "layer", f"split mode auto: layer ({e})"
    return "tensor", (f"split mode auto: tensor (each device's share of a layer, {each / MiB:.1f} MiB, is at "
                      f"least {AUTO_TENSOR_SHARE_BYTES / MiB:.0f} MiB)")


def plan_shards(f: GGUFFile, hp: HParams, ngl: str | int | None, devices: list[Device],
                tensor_split: str | None, n_ctx: int = 2048, n_ubatch: int = 256) -> tuple[list[Shard], str]:
    """Split mode "tensor": every device before the CPU (RPC servers, GPUs) takes a share of
    every layer, in proportion to ``-ts`` or to its free memory; the description lists them.
    A share larger than its device's free memory is an error that says how much is missing."""
    if ngl is not None and str(ngl).strip().lower() not in ("auto", "all", "-1"):
        raise PlacementError(f"--split-mode tensor divides every layer among the devices; it cannot be combined "
                             f"with -ngl {ngl} (use auto or all)")
    candidates = list(range(len(devices) - 1))
    if not candidates:
        raise PlacementError("--split-mode tensor needs devices to divide the layers among (--rpc servers or GPUs)")
    free = [devices[d].get_memory()[0] for d in candidates]
    weights = parse_split(tensor_split, len(candidates)) or [float(max(x, 1)) for x in free]
    chosen = [d for d in candidates if weights[d] > 0]
    try:
        shards = plan_tensor_split(hp, chosen, [weights[d] for d in chosen])
    except SplitError as e:
        raise PlacementError(str(e)) from None
    need = [shard_bytes(f, hp, shards, i, n_ctx, n_ubatch) for i in range(len(shards))]
    free_of = {s.device: devices[s.device].get_memory()[0] for s in shards}
    rows = [f"{'id':>3}  {'device':<28} share (split mode tensor; the first also holds the embedding)"]
    rows += [f"{s.device:>3}  {devices[s.device].get_name():<28} {s.describe()}, "
             f"{n / MiB:.0f} MiB of {free_of[s.device] / MiB:.0f} MiB free" for s, n in zip(shards, need)]
    over = [(s, n) for s, n in zip(shards, need) if n > free_of[s.device]]
    if over:
        raise PlacementError("the model does not fit the devices' memory with split mode tensor: " + "; ".join(
            f"{devices[s.device].get_name()} would need {n / MiB:.0f} MiB and has {free_of[s.device] / MiB:.0f} MiB "
            f"free ({(n - free_of[s.device]) / MiB:.0f} MiB missing)" for s, n in over))
    return shards, "\n".join(rows)


def shard_bytes(f: GGUFFile, hp: HParams, shards: list[Shard], i: int, n_ctx: int, n_ubatch: int) -> int:
    """What shard ``i`` needs on its device: its weights, its heads' KV cache (F16 keys and
    values) and compute buffers as model_sizes reckons them, for its rows of the head too."""
    s = shards[i]
    weights = sum(t.nbytes() for t in shard_weights(f, shards, hp, {})[i].values())
    kv_heads = s.kv_heads[1] - s.kv_heads[0]
    kv = n_ctx * hp.n_layer * kv_heads * (hp.n_embd_head_k + hp.n_embd_head_v) * 2
    compute = n_ubatch * (6 * hp.n_embd + 3 * hp.n_ff) * 4 + n_ubatch * (s.vocab_rows[1] - s.vocab_rows[0]) * 4
    return weights + kv + compute


def shard_weights(f: GGUFFile, shards: list[Shard], hp: HParams,
                  sources: dict[int, FileSlice]) -> list[dict[str, Tensor]]:
    """Each shard's weights: its rows of the split ones and of the head (``sources`` says where
    they lie in the file), a copy of the rest of each layer (the norms) and of the small tables
    every layer reads; the embedding on the first alone (the others hold their rows of it where
    it is the head too)."""
    tied = "output.weight" not in f.tensors
    out = []
    for i, shard in enumerate(shards):
        mine = {}
        for name in f.tensors:
            rows = shard_rows(name, shard, hp)
            if i and name == "token_embd.weight":
                if not tied:
                    continue
                rows = shard.vocab_rows
            t = f.new_tensor(name)
            if rows is not None:
                t, sources[id(t)] = shard_tensor(t, rows)
            mine[name] = t
        out.append(mine)
    return out


# the order in which a layer's graph (blocks.py) reads its weights
LAYER_READ_ORDER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                    "post_attention_norm", "ffn_norm", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_gate_exps",
                    "ffn_up_exps", "ffn_down", "ffn_down_exps", "post_ffw_norm")


def read_order(name: str) -> tuple[int, bool, int, str]:
    """Where a weight goes in memory: the embedding, each layer's weights in the order its graph
    reads them (LAYER_READ_ORDER, anything else after; the biases after them all, so that they
    do not come between the matrices), the output last.  A decoding step then reads its weights
    as one stream from the first layer to the last, the products of one input lie one after
    another and the CPU runs them as one (pyggml/cpu/fusion.py): in the file's order
    (alphabetical per layer) SmolLM2 decodes about 6% slower."""
    if name.startswith("token_embd."):
        return -1, False, 0, name
    parts = name.split(".")
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit():
        kind = parts[2]
        at = LAYER_READ_ORDER.index(kind) if kind in LAYER_READ_ORDER else len(LAYER_READ_ORDER)
        return int(parts[1]), parts[-1] == "bias", at, name
    return 1 << 30, False, 0, name


def map_weights(host_bytes: int, use_mmap: bool | None) -> bool:
    """Whether host weights stay in the file's map (``use_mmap``; by default only where reading
    them into memory would take more than half of what is free: the map lets the system drop
    pages under pressure) rather than being read into memory in read_order."""
    if use_mmap is not None:
        return use_mmap
    from pyggml import cpu_device
    return host_bytes > cpu_device().get_memory()[0] // 2


def load_model(path: str | os.PathLike, ngl: str | int | None = None, devices: list[Device] | None = None,
               progress: bool | None = None, n_ctx: int = 2048, n_ubatch: int = 256,
               tensor_split: str | None = None, on_plan: Callable[[str], None] | None = None,
               use_mmap: bool | None = None, split_mode: str = "layer", place_by: str = "speed") -> LoadedModel:
    """Open ``path``, place it (``on_plan`` hears the plan's description before any weight
    moves) and load its weights, in read_order (host weights stay in the file's map where
    map_weights says so).  ``split_mode`` "tensor" divides every layer among the devices
    (tensor_split.py) instead of giving each device whole layers; "auto" chooses
    (choose_split_mode)."""
    if split_mode not in SPLIT_MODES:
        raise PlacementError(f"split mode {split_mode!r}: choose one of {', '.join(SPLIT_MODES)}")
    f, arch = open_gguf(path)
    hp = HParams.from_gguf(f, f.architecture)
    arch.adjust_hparams(hp)
    devices = devices or default_devices()
    chose = ""
    if split_mode == "auto":
        split_mode, chose = choose_split_mode(f, hp, ngl, devices, tensor_split)
    if split_mode == "tensor":
        shards, description = plan_shards(f, hp, ngl, devices, tensor_split, n_ctx, n_ubatch)
        lead = shards[0].device
        placement = Placement(lead, lead, [lead] * hp.n_layer)
    else:
        shards = None
        placement, description = plan(f, hp, ngl, devices, n_ctx, n_ubatch, tensor_split, place_by)
    if chose:
        description = f"{chose}\n{description}"
    for d in devices:
        description += "".join(f"\nnote: {d.get_name()} is {note}" for note in d.limitations())
    if on_plan is not None:
        on_plan(description)
    model = LoadedModel(Path(path), f, hp, arch, devices, placement, shards=shards)
    if shards is not None:
        sources: dict[int, FileSlice] = {}
        model.shard_weights = shard_weights(f, shards, hp, sources)
        to_load = [t for mine in model.shard_weights for t in mine.values()]
        buft_of = {id(t): devices[s.device].get_buffer_type() for s, mine in zip(shards, model.shard_weights)
                   for t in mine.values()}
        to_load.sort(key=lambda t: read_order(t.name))
        model.buffers = f.load(to_load, lambda t: buft_of[id(t)], progress=progress,
                               source_of=lambda t: sources.get(id(t), t.name), mmap=False)
        model.weights = model.shard_weights[0]
        return model

    weights = {name: f.new_tensor(name) for name in f.tensors}
    buft_of = {id(t): devices[placement.device_of(name)].get_buffer_type() for name, t in weights.items()}
    to_load = list(weights.values())
    if "output.weight" not in weights and placement.prolog != placement.epilog:
        # a tied head must sit with the epilog: a second copy of the embedding table there
        head = Tensor(weights["token_embd.weight"].type, weights["token_embd.weight"].ne, name="output.weight")
        buft_of[id(head)] = devices[placement.epilog].get_buffer_type()
        weights["output.weight"] = head
        to_load.append(head)
    to_load.sort(key=lambda t: read_order(t.name))
    host_bytes = sum(t.nbytes() for t in to_load if buft_of[id(t)].is_host())
    model.buffers = f.load(to_load, lambda t: buft_of[id(t)], progress=progress,
                           source_of=lambda t: t.name if t.name in f.tensors else "token_embd.weight",
                           mmap=map_weights(host_bytes, use_mmap))
    model.weights = weights
    return model
