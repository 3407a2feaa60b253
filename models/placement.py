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
