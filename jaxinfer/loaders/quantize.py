"""Quantize a model while it loads, one weight at a time, never holding the float model.

``assemble`` hands every weight to a ``WeightQuantizer`` as soon as it is read; the
quantizer returns the (index, leaf) pairs that are ready. Which weights: those whose
``WeightSpec.contract`` names the axes the model's einsum sums over (every matmul weight
and the embedding / LM head); norms and biases stay float.

int8, int4: each weight is quantized as it arrives and its float copy dropped.

w8a8: SmoothQuant needs, for each matmul, the largest |x| its input reaches on each channel.
Those come from running ``CALIBRATION_PROMPTS`` through the model, which must not exist in
float as a whole. So calibration goes layer by layer, in checkpoint order. The calibration
tokens are embedded with the already quantized table; the float weights of layer i are held
until the layer is complete, then the hidden state runs through float layer i (the model's
own ``forward`` over a one-layer weights tree, ``_run_layer``), its matmul weights wrapped so
each records ``channel_absmax`` of its input; layer i is quantized with those maxima, its
float weights dropped, and the hidden state advanced through the quantized layer i. Layer
i's statistics are thus those of the quantized model it will sit in (as GPTQ-style
sequential calibration does), the peak holds one float layer, and the cost is two jitted
one-layer passes per layer (compiled once per kind of layer).
The embedding / tied LM head arrives first, before any hidden state exists, and is kept
weight-only int8 under int4 (see ``head_scheme``).

No smoothing runs at run time (``fold_smoothing``): the weights one norm feeds (q/k/v;
gate/up) share one smoothing vector s, computed from their common input's maxima and the
largest row of any of them, and 1/s is folded into that norm's weight. ``w_down`` and ``wo``
read the output of another matmul channel for channel (``w_up`` through the gate product;
``wv`` through attention, query head n reading kv head n // G), so their 1/s is folded into
that matmul's per-output-channel scale (and bias): exact, where a norm fold is not possible.
With ``QuantConfig.fold_smoothing`` off (LoRA adapters: an adapter's A must read the model's own
activation, not one divided by s) each weight keeps its s and multiplies x by it at run time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import quant
from jaxinfer.errors import InvalidRequest
from jaxinfer.quant import QuantConfig, QuantScheme

# A fixed, small calibration set for w8a8 smoothing: varied English registers (narrative,
# technical, dialogue, lists, numbers), concatenated into one sequence (351 SmolLM2 tokens).
CALIBRATION_PROMPTS = (
    ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
     "one hundred and twelve steps under his breath, and when he reached the lamp room he wiped "
     "the salt from the glass before lighting the wick."),
    ("To install the package, create a virtual environment, activate it, and run pip install "
     "with the requirements file. If the build fails, check that your compiler supports C++17 "
     "and that the CUDA toolkit version matches the driver."),
    ("Q: Why does ice float on water?\nA: Because water expands as it freezes. The hydrogen "
     "bonds lock the molecules into an open hexagonal lattice, so solid ice is about nine "
     "percent less dense than the liquid around it."),
    ("Quarterly revenue rose 14% to $3.2 billion, while operating costs fell from 41% to 37% of "
     "sales. The board approved a dividend of 0.45 per share, payable on March 15, 2025."),
    ("Dear Maria, thank you for the wonderful dinner last Saturday. The lemon tart was the best "
     "I have ever tasted, and I would love the recipe if you are willing to share it."),
    ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    "
     "return a\n\nprint([fibonacci(i) for i in range(10)])"),
    ("Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is "
     "split, oxygen is released, and carbon dioxide is fixed into sugars by the Calvin cycle."),
    ("Shopping list: two loaves of bread, a dozen eggs, olive oil, fresh basil, three tomatoes, "
     "and something sweet for the weekend."),
)


# w8a8 smoothing folds, by weight name (the same in every family). The weights each norm feeds:
# they share one smoothing vector, folded into the norm's weight.
NORM_FEEDS = {"attn_norm": ("wq", "wk", "wv"), "mlp_norm": ("w_gate", "w_up")}
# A weight whose input is another's output, channel for channel: consumer -> (producer, its
# bias or None). wo's input channel (n, h) is v's channel (n // G, h).
PRODUCERS = {"w_down": ("w_up", None), "wo": ("wv", "bv")}


def weight_name(key: tuple[str, ...], layer: int | None) -> str:
    """("layers", "wo"), 3 -> "layers/3/wo"."""
    return "/".join(key[:1] + ((str(layer),) if layer is not None else ()) + key[1:])


def quantize_weight(name: str, spec, w: jax.Array, qcfg: QuantConfig, scheme=None,
                    act_absmax=None):
    """One weight by its declaration: a QuantArray, or ``w`` itself when the spec contracts
    nothing (norms, biases)."""
    contract = spec.contract_axes
    if not contract:
        return w
    scheme = scheme or head_scheme(spec, qcfg)
    if scheme == QuantScheme.INT4:
        group = quant.int4_group(name, tuple(w.shape), contract, qcfg.group)
        return quant.quantize_int4(w, contract, group)
    if scheme == QuantScheme.W8A8:
        return quant.quantize_w8a8(w, contract, act_absmax, alpha=qcfg.alpha)
    return quant.quantize_int8(w, contract)


def head_scheme(spec, qcfg: QuantConfig) -> QuantScheme:
    """The scheme of one weight: the model's, except for the embedding / LM head (a weight
    with a "vocab" axis). Under int4 it is int8 weight-only: measured on SmolLM2 (tied head,
    256 tokens), int4 everywhere raised perplexity 56% over float32, int4 with an int8 head 25%
    (llama.cpp's Q4_K_M likewise keeps the output matrix at 6 bits). Under w8a8 it is w8a8
    without smoothing: the tied table arrives first, before any hidden state exists to
    calibrate one, and as weight-only int8 XLA CPU widened all 28M of its entries to float32
    on every decode step."""
    if "vocab" in spec.axes and qcfg.scheme == QuantScheme.INT4:
        return QuantScheme.INT8
    return qcfg.scheme


def check_quantizable(specs, cfg, qcfg: QuantConfig) -> None:
    """Fail before reading any tensor if a weight cannot take the scheme (an int4 group that
    does not divide a contraction; w8a8's layer-by-layer calibration, which does not cover a
    mixture of experts)."""
    from jaxinfer.models.layers import is_spec, weight_key

    if qcfg.scheme == QuantScheme.W8A8 and any("expert" in s.axes for s in jax.tree.leaves(specs, is_leaf=is_spec)):
        raise InvalidRequest("quantize='w8a8' does not cover mixture-of-experts models yet; use int8 or int4")
    if qcfg.scheme != QuantScheme.INT4:
        return

    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        if spec.contract_axes and head_scheme(spec, qcfg) == QuantScheme.INT4:
            quant.int4_group(weight_name(*weight_key(path)), spec.shape, spec.contract_axes, qcfg.group)


class WeightQuantizer:
    """Receives every weight of a checkpoint in the order of the flattened specs; ``add``
    and ``finish`` return the (leaf index, leaf) pairs ready to go into the pytree."""

    def __init__(self, qcfg: QuantConfig, *, cfg=None, family=None, tokenizer=None):
        self.qcfg = qcfg
        if qcfg.scheme == QuantScheme.W8A8:
            if tokenizer is None:
                raise InvalidRequest(
                    "quantize='w8a8' calibrates on text and this checkpoint has no tokenizer; "
                    "use int8 or int4"
                )
            self.calib = _Calibration(cfg, family, tokenizer, qcfg)

    def add(self, index: int, key: tuple[str, ...], layer: int | None, spec, w: jax.Array):
        name = weight_name(key, layer)
        if self.qcfg.scheme != QuantScheme.W8A8:
            return [(index, quantize_weight(name, spec, w, self.qcfg))]
        return self.calib.add(index, key, layer, name, spec, w)

    def finish(self):
        return self.calib.finish() if self.qcfg.scheme == QuantScheme.W8A8 else []


class _Observed:
    """A float weight that records, per einsum, the max |x| of each contracted input channel
    (``layers.dot`` calls ``.einsum`` on anything that has one)."""

    def __init__(self, w: jax.Array, n_contract: int):
        self.w, self.n_contract, self.absmax = w, n_contract, None

    def einsum(self, eq: str, x: jax.Array, *, matmul=None) -> jax.Array:
        del matmul  # a float weight: no quantized kernel to route through
        lhs, out = eq.replace(" ", "").split("->")
        xs, ws = lhs.split(",")
        # the contracted letters in x's order -> move them last for channel_absmax
        c = "".join(ch for ch in xs if ch in ws and ch not in out)
        xt = jnp.einsum(f"{xs}->{''.join(ch for ch in xs if ch not in c)}{c}", x)
        # channel order must follow the weight's contracted axes (QuantArray's flattening)
        wc = "".join(ch for ch in ws if ch in c)
        xt = jnp.einsum(f"...{c}->...{wc}", xt) if wc != c else xt
        m = quant.channel_absmax(xt, self.n_contract)
        self.absmax = m if self.absmax is None else jnp.maximum(self.absmax, m)
        return jnp.einsum(eq, x, self.w.astype(x.dtype))


class _Inject:
    """An embedding table whose lookup returns a given hidden state: runs the model's own
    ``forward`` on one layer from the hidden state the layers below produced."""

    def __init__(self, x: jax.Array):
        self.x = x

    def take(self, tokens):
        return self.x


def _run_layer(mod, contracts, layer, x, tokens, *, cfg, observe):
    """x [B, T, D] through one layer (cfg: that layer alone) -> (x out, {name: absmax} of
    the matmul inputs when ``observe``)."""
    ones = mod.embed({"embed": _Inject(jnp.ones_like(x))}, tokens, cfg)  # embed may scale
    observed = {n: _Observed(w, contracts[n]) if observe and n in contracts else w
                for n, w in layer.items()}
    weights = {"embed": _Inject(x / ones), "layers": [observed]}
    out, _ = mod.forward(weights, tokens, jnp.zeros(tokens.shape[0], jnp.int32), None, cfg=cfg,
                         read_cache=False)
    return out, {n: w.absmax for n, w in observed.items() if isinstance(w, _Observed)}


def one_layer_config(cfg, i: int):
    """The config of a one-layer model that computes what layer i of ``cfg``'s model does: cut
    to layer i's kind (window, rotary) and NoPE."""
    return dataclasses.replace(cfg, n_layers=1, layer_kinds=cfg.layer_kinds[i : i + 1],
                               nope_layers=(0,) if i in cfg.nope_layers else ())


class _Calibration:
    """Layer-by-layer SmoothQuant calibration (see the module docstring). Two jitted passes
    per layer: float with observers (the statistics), then quantized (the next layer's input),
    so each layer costs two passes over the calibration tokens and the program compiles once
    per kind of layer."""

    def __init__(self, cfg, family, tokenizer, qcfg: QuantConfig):
        import functools

        from jaxinfer.models.registry import model_family

        self.cfg, self.qcfg = cfg, qcfg
        self.mod = model_family(family if family is not None else cfg.family)
        if not self.mod.w8a8_calibration:
            raise InvalidRequest(f"quantize='w8a8' is not supported for {cfg.family} models "
                                 "(its layers cannot be calibrated one at a time); use int8 or int4")
        ids: list[int] = []
        for p in CALIBRATION_PROMPTS:
            ids += tokenizer.encode(p)
        self.tokens = jnp.asarray([ids[: cfg.max_position]], jnp.int32)
        layer_specs = self.mod.weight_specs(cfg)["layers"][0]
        self.layer_names = set(layer_specs)
        contracts = {n: len(sp.contract_axes) for n, sp in layer_specs.items() if sp.contract_axes}
        self.run = jax.jit(functools.partial(_run_layer, self.mod, contracts), static_argnames=("cfg", "observe"))
        self.layer_cfg = functools.partial(one_layer_config, cfg)
        self.x = None  # hidden state entering the next layer, [1, T, D]
        # Calibration runs each layer on one device, even when the model loads sharded (the
        # peak there: one float layer). Sharded matmuls sum in another order, the maxima move
        # by an ulp, and a rounding flipped in one layer's int8 weights moves every later
        # layer's statistics: on one device the quantized weights are the same whatever the
        # mesh, so a sharded w8a8 model computes what the one-device one does.
        self.device = jax.local_devices()[0]
        self.n_done = 0
        self.pending: dict[str, tuple[int, object, jax.Array]] = {}

    def add(self, index, key, layer, name, spec, w):
        if layer is None:  # embedding / LM head (weight-only int8: head_scheme), final norm
            q = quantize_weight(name, spec, w, self.qcfg)
            if key == ("embed",):
                self.x = jax.device_put(self.mod.embed({"embed": q}, self.tokens, self.cfg), self.device)
            return [(index, q)]
        if self.x is None:
            raise InvalidRequest("w8a8 calibration needs the embedding before the layers")
        if layer != self.n_done:
            raise InvalidRequest(f"w8a8 calibration needs layers in order; got {layer} after {self.n_done}")
        self.pending[key[1]] = (index, spec, w)
        if set(self.pending) != self.layer_names:
            return []
        return self._calibrate_layer(layer)

    def _calibrate_layer(self, i: int):
        cfg = self.layer_cfg(i)
        floats = jax.device_put({n: w for n, (_, _, w) in self.pending.items()}, self.device)
        _, absmax = self.run(floats, self.x, self.tokens, cfg=cfg, observe=True)
        specs = {n: spec for n, (_, spec, _) in self.pending.items()}
        qlayer = _smooth_layer(floats, specs, absmax, self.qcfg, cfg, name=f"layers/{i}")
        ready = [(index, qlayer[n]) for n, (index, _, _) in self.pending.items()]
        self.x, _ = self.run(qlayer, self.x, self.tokens, cfg=cfg, observe=False)
        self.n_done += 1
        self.pending = {}
        return ready

    def finish(self):
        if self.pending:
            raise InvalidRequest(f"w8a8 calibration: layer {self.n_done} is incomplete")
        return []




def smoothing_vectors(floats: dict, specs: dict, absmax: dict, cfg, alpha: float) -> dict:
    """SmoothQuant's s f32[I] for each matmul weight of one layer that a fold covers (module
    docstring), by weight name: one s shared by the weights a norm feeds; one per kv channel
    (repeated over the G query heads) for wo."""
    def rows(n):
        return quant.weight_row_absmax(floats[n], specs[n].contract_axes)

    out = {}
    for norm, names in NORM_FEEDS.items():
        if norm in floats and all(n in absmax for n in names):
            a = jnp.max(jnp.stack([absmax[n].reshape(-1) for n in names]), axis=0)
            s = quant.smoothing_scale(a, jnp.max(jnp.stack([rows(n) for n in names]), axis=0), alpha)
            out.update({n: s for n in names})
    K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    for n, (producer, _) in PRODUCERS.items():
        if n in absmax and producer in out:
            a, r = absmax[n].reshape(-1), rows(n)
            if n == "wo":  # one s per kv channel (k, h), shared by the G query heads reading it
                a, r = (jnp.max(v.reshape(K, G, H), axis=1).reshape(-1) for v in (a, r))
                out[n] = jnp.repeat(quant.smoothing_scale(a, r, alpha).reshape(K, 1, H), G, axis=1).reshape(-1)
            else:
                out[n] = quant.smoothing_scale(a, r, alpha)
    return out


def fold_smoothing(floats: dict, specs: dict, svec: dict, cfg) -> dict:
    """One layer's weights with smoothing vectors ``svec`` (``smoothing_vectors``) folded: the
    w8a8 weights stored as diag(s) W with no run-time smoothing, 1/s in the norm feeding them
    or in the per-output-channel scale (and bias) of the matmul producing their input. Norms,
    biases and the w8a8 QuantArrays of the covered weights, by name."""
    from jaxinfer.models.registry import model_family

    offset = model_family(cfg.family).norm_offset  # Gemma 2/3's norms scale by 1 + w
    out = {n: quant.quantize_w8a8(floats[n], specs[n].contract_axes, smooth_in=s) for n, s in svec.items()}
    for norm, names in NORM_FEEDS.items():
        if names[0] in svec:
            w, s = floats[norm].astype(jnp.float32), svec[names[0]]
            folded = (offset + w) / s - offset
            out[norm] = folded.astype(floats[norm].dtype)
    K, G, H = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    for n, (producer, bias) in PRODUCERS.items():
        if n in svec:
            s = svec[n].reshape(K, G, H)[:, 0].reshape(-1) if n == "wo" else svec[n]
            p = out[producer]
            out[producer] = dataclasses.replace(p, scale=p.scale / s)
            if bias is not None and bias in floats:
                b = floats[bias]
                out[bias] = (b.astype(jnp.float32) / s.reshape(b.shape)).astype(b.dtype)
    return out


def _smooth_layer(floats: dict, specs: dict, absmax: dict, qcfg: QuantConfig, cfg, *, name: str) -> dict:
    """One layer under w8a8 with every smoothing the folds cover folded (unless
    ``qcfg.fold_smoothing`` is off); a weight they do not cover keeps run-time smoothing."""
    out = (fold_smoothing(floats, specs, smoothing_vectors(floats, specs, absmax, cfg, qcfg.alpha), cfg)
           if qcfg.fold_smoothing else {})
    for n, w in floats.items():
        if n not in out:
            out[n] = quantize_weight(f"{name}/{n}", specs[n], w, qcfg, act_absmax=absmax.get(n))
    return out
