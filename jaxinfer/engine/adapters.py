"""LoRA adapters inside the engine: the manager of their device stacks, placed with the weights
(one device, or split over the mesh's "model" axis like each target's base weight)."""

from __future__ import annotations

import jax


def lora_manager(cfg, config, weights, mesh, place_one, model_names, download_dir):
    """The LoRA adapters' manager (``lora.LoRAManager``), its stacks placed with the weights:
    ``place_one`` on one device, else split as ``_lora_placement`` says. Refused, with the
    reason, for base weights an adapter cannot be added to (``lora.check_base``)."""
    from jaxinfer.lora import LoRAManager, check_base
    from jaxinfer.models.registry import model_family

    check_base(weights)
    place = place_one if mesh is None else _lora_placement(mesh, weights["layers"][0])
    return LoRAManager(cfg, model_family(cfg.family), config, place=place, model_names=model_names,
                       download_dir=download_dir)


def _lora_placement(mesh, layer: dict):
    """How LoRA stacks and slot contents are placed under tensor parallelism: each target's A
    split over "model" like its base weight's input, its B like the base's output (replicated
    where the base is), so each device computes its own part of the adapter's term as of the base
    product. Trees of {"layers": [{weight: (a [I, ..., R], b [..., R, O])}]}."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxinfer import quant
    from jaxinfer.sharding import Placed

    def split(w) -> tuple[bool, bool]:  # (input split, output split) of a base weight over "model"
        w = w.value if isinstance(w, Placed) else w
        arr = getattr(w, "values", w)
        spec = tuple(getattr(getattr(arr, "sharding", None), "spec", ()) or ())
        on = lambda a: a == "model" or (isinstance(a, tuple) and "model" in a)  # noqa: E731
        if isinstance(w, quant.QuantArray):  # stored as the matrix [I, O]
            spec = spec + (None, None)
            return on(spec[0]), on(spec[1])
        n = len(getattr(w, "contract", ())) or 1
        return any(map(on, spec[:n])), any(map(on, spec[n:]))

    def put(a, axis: int, split_: bool):
        spec = [None] * a.ndim
        spec[axis] = "model" if split_ else None
        return jax.device_put(a, NamedSharding(mesh, PartitionSpec(*spec)))

    def place(tree):
        out = []
        for layer_t in tree["layers"]:
            one = {}
            for w, (a, b) in layer_t.items():
                ins, outs = split(layer[w])
                one[w] = (put(a, 0, ins), put(b, b.ndim - 1, outs))
            out.append(one)
        return {"layers": out}

    return place
