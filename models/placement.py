"""Which device holds which part of a model: ``-ngl`` as chatllm.cpp spells it.

    -ngl [id:]spec[;id:spec]...    spec = N | prolog | epilog | all | comma-joined mix

Device ids index the device list (RPC endpoints first, then local GPUs, then the CPU,
which is always last and holds everything not placed).  ``prolog`` is the token
embedding, ``epilog`` the final norm and output head, ``N`` the next N layers not yet
placed (asking for more layers than remain places the epilog too, as llama.cpp's
``-ngl 99`` does), ``all`` every remaining layer plus prolog and epilog when not yet placed.
Assignments are taken in the order written.  llama.cpp habits work too: a bare number
(``-ngl 16``) means device 0, ``-ngl -1`` and ``-ngl all`` put everything on device 0.
"""
from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    pass


@dataclass
class Placement:
    prolog: int
    epilog: int
    layers: list[int]

    def device_of(self, tensor_name: str) -> int:
        """The device of a GGUF tensor: ``blk.N.*`` follows layer N, the embedding the prolog,
        everything else (final norm, head, shared tables) the epilog."""
        if tensor_name.startswith("blk."):
            return self.layers[int(tensor_name.split(".", 2)[1])]
        if tensor_name.startswith("token_embd"):
            return self.prolog
        return self.epilog

    def used(self) -> list[int]:
        return sorted({self.prolog, self.epilog, *self.layers})


def parse_ngl(spec: str | int | None, n_layer: int, device_names: list[str]) -> Placement:
    """Parse an ``-ngl`` specification against the device list (the CPU last)."""
    cpu = len(device_names) - 1
    placement = Placement(cpu, cpu, [cpu] * n_layer)
    if spec is None or str(spec).strip() == "":
        return placement
    text = str(spec).strip()
    if text.lstrip("-").isdigit() and int(text) < 0:
        text = "all"  # llama.cpp's -ngl -1
    placed_prolog = placed_epilog = False
    next_layer = 0
    for part in filter(None, (p.strip() for p in text.split(";"))):
        dev_text, sep, what = part.partition(":")
        if not sep:
            dev_text, what = "0", part
        try:
            dev = int(dev_text)
        except ValueError:
            raise PlacementError(f"-ngl: {dev_text!r} in {part!r} is not a device id") from None
        if not 0 <= dev < len(device_names):
            listing = ", ".join(f"{i}: {n}" for i, n in enumerate(device_names))
            raise PlacementError(f"-ngl: unknown device id {dev}; devices are {listing}")
        for item in filter(None, (w.strip().lower() for w in what.split(","))):
            if item == "prolog":
                placement.prolog, placed_prolog = dev, True
            elif item == "epilog":
                placement.epilog, placed_epilog = dev, True
            elif item == "all":
                for il in range(next_layer, n_layer):
                    placement.layers[il] = dev
                next_layer = n_layer
                if not placed_prolog:
                    placement.prolog, placed_prolog = dev, True
                if not placed_epilog:
                    placement.epilog, placed_epilog = dev, True
            elif item.isdigit():
                want, n = int(item), min(int(item), n_layer - next_layer)
                for il in range(next_layer, next_layer + n):
                    placement.layers[il] = dev
                next_layer += n
                if want > n and not placed_epilog:  # llama.cpp: -ngl 99 offloads the output layer too
                    placement.epilog, placed_epilog = dev, True
            else:
                raise PlacementError(f"-ngl: {item!r} is not a layer count, 'prolog', 'epilog' or 'all'")
    return placement


# -- automatic placement (-ngl auto, -ts) -----------------------------------------------------------

MiB = 1 << 20


@dataclass
class Sizes:
    """Bytes each part of a model needs on its device: weights per layer, KV cache per layer,
    the embedding (prolog), the final norm and head (epilog; ``tied_head``: the head is the
    embedding, copied when the two sit apart), and the compute buffers a device reserves."""
    layer_weights: list[int]
    layer_kv: list[int]
    prolog: int
    epilog: int
    tied_head: int
    compute: int
    head_compute: int

    def need(self, placement: Placement, dev: int) -> tuple[int, int]:
        """(weight bytes, KV bytes) that ``placement`` puts on device ``dev``."""
        weights = sum(w for w, d in zip(self.layer_weights, placement.layers) if d == dev)
        kv = sum(k for k, d in zip(self.layer_kv, placement.layers) if d == dev)
        if placement.prolog == dev:
            weights += self.prolog
        if placement.epilog == dev:
            weights += self.epilog + (self.tied_head if placement.prolog != placement.epilog else 0)
        return weights, kv

    def total(self, placement: Placement, dev: int) -> int:
        if dev not in placement.used():
            return 0
        weights, kv = self.need(placement, dev)
        return weights + kv + self.compute + (self.head_compute if placement.epilog == dev else 0)


def parse_split(text: str | None, n_devices: int) -> list[float] | None:
    """``-ts 3,1``: one proportion per device (the CPU excluded), in id order."""
    if text is None or str(text).strip() == "":
        return None
    try:
        parts = [float(x) for x in str(text).replace("/", ",").split(",")]
    except ValueError:
        raise PlacementError(f"-ts/--tensor-split: {text!r} is not a comma-separated list of numbers") from None
    if len(parts) > n_devices or any(p < 0 for p in parts) or not any(parts):
        raise PlacementError(f"-ts/--tensor-split: {text!r} needs at most {n_devices} non-negative proportions "
                             f"(one per device before the CPU), not all zero")
    return parts + [0.0] * (n_devices - len(parts))


def plan_auto(sizes: Sizes, names: list[str], free: list[int], split: list[float] | None = None,
              speeds: list[float] | None = None) -> Placement:
    """Spread the layers over the devices before the CPU (RPC servers, GPUs) in proportion
    to ``split``, or to ``speeds`` (each device's measured GB/s through products: a decoding
    step then takes each device about as long), or to each device's free memory less its
    compute buffers, as llama.cpp's default split does; the embedding goes with the first
    layer, the head with the last.
    No device is given more than its free memory: layers move to a neighbour with room,
    and when none has room the error says how much is missing where.  With no device but
    the CPU, everything stays there."""
    cpu = len(names) - 1
    n_layer = len(sizes.layer_weights)
    if cpu == 0:
        return Placement(cpu, cpu, [cpu] * n_layer)
    candidates = list(range(cpu))
    weights = split if split is not None else list(speeds) if speeds else \
        [max(0, free[d] - sizes.compute) for d in candidates]
    total = sum(weights)
    if total <= 0:
        raise PlacementError("-ngl auto: no device has free memory left after its compute buffers: "
                             + ", ".join(f"{names[d]} {free[d] / MiB:.0f} MiB free" for d in candidates))
    bounds, acc = [], 0.0
    for w in weights:
        acc += w / total
        bounds.append(acc)
    layers = []
    for il in range(n_layer):
        at = il / n_layer  # llama.cpp: the first device whose share ends beyond il / n_layer
        layers.append(next((d for d in candidates if at < bounds[d] and weights[d] > 0),
                           max(d for d in candidates if weights[d] > 0)))
    placement = Placement(layers[0] if layers else 0, layers[-1] if layers else 0, layers)
    if split is None:
        _fit(placement, sizes, free, candidates)
    over = [d for d in candidates if sizes.total(placement, d) > free[d]]
    if over:
        raise PlacementError("the model does not fit the devices' memory: " + "; ".join(
            f"{names[d]} would need {sizes.total(placement, d) / MiB:.0f} MiB and has {free[d] / MiB:.0f} MiB free "
            f"({(sizes.total(placement, d) - free[d]) / MiB:.0f} MiB missing)" for d in over)
            + (f"; all devices together have {sum(free[d] for d in candidates) / MiB:.0f} MiB free"
               if len(candidates) > 1 else ""))
    return placement


def _fit(p: Placement, sizes: Sizes, free: list[int], candidates: list[int]) -> None:
    """Move boundary layers off devices over their memory onto neighbours with room."""
    for _ in range(len(p.layers) * len(candidates)):
        over = [d for d in candidates if sizes.total(p, d) > free[d]]
        if not over:
            return
        d = over[0]
        mine = [il for il, x in enumerate(p.layers) if x == d]
        moved = False
        for il, other in ((mine[0], p.layers[mine[0] - 1] if mine[0] > 0 else None),
                          (mine[-1], p.layers[mine[-1] + 1] if mine[-1] + 1 < len(p.layers) else None)):
            if other is None or other == d:
                continue
            p.layers[il] = other
            p.prolog, p.epilog = p.layers[0], p.layers[-1]
            if sizes.total(p, other) <= free[other]:
                moved = True
                break
            p.layers[il] = d
            p.prolog, p.epilog = p.layers[0], p.layers[-1]
        if not moved:
            return


def describe(p: Placement, sizes: Sizes, names: list[str], free: list[int],
             measured: list[str] | None = None) -> str:
    """The plan as a table: per device its id, name, layers, weight, KV and free MiB (and
    ``measured``: what -ngl auto placed by, per device, when it was speed)."""
    rows = [f"{'id':>3}  {'device':<28} {'layers':<16} {'weights':>11} {'KV':>10} {'free':>12}"
            + ("  measured" if measured else "")]
    for d in p.used():
        mine = [il for il, x in enumerate(p.layers) if x == d]
        spanned = spans(mine)
        extra = [s for s, on in (("prolog", p.prolog == d), ("epilog", p.epilog == d)) if on]
        weights, kv = sizes.need(p, d)
        rows.append(f"{d:>3}  {names[d]:<28} {','.join([spanned] * bool(spanned) + extra):<16} "
                    f"{weights / MiB:>7.1f} MiB {kv / MiB:>6.1f} MiB {free[d] / MiB:>8.0f} MiB"
                    + (f"  {measured[d]}" if measured and d < len(measured) else ""))
    return "\n".join(rows)


def spans(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)
