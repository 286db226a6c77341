"""The one interface a model family plugs in through: a ``ModelFamily`` that the family's file
builds and ``models.registry`` finds by name.

It holds what the rest of the package needs from a family and nothing else: how its
checkpoints are recognised (HF architectures, GGUF architectures) and read (config parsing,
checkpoint names, the few rewrites a converter made), its weights (``weight_specs``), the
family's own small config class (the knobs only it has, in ``ModelConfig.family_config``), and
its forward pieces. The loaders, the engine and quantization read these fields and nothing
else of a family's module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.models.layers import rope_inv_freq, rope_table

# our weight path -> (HF tensor name, GGUF tensor name, transpose); "{i}" is the layer index
CheckpointNames = Mapping[tuple[str, ...], tuple[str, str, bool]]


def _no_prefixes(hf: dict) -> tuple[str, ...]:
    return ()


@dataclasses.dataclass(frozen=True)
class TextTower:
    """Where a multimodal checkpoint keeps its text decoder: the prefix that stands for "model."
    in the family's checkpoint names, and the name of its LM head. Checkpoints of one
    architecture differ by the transformers version that wrote them (Gemma 3: the published
    "language_model.model." or "model.language_model."), so a family lists every layout and
    the loader takes the one whose embedding the checkpoint carries."""

    prefix: str  # "language_model.model."
    lm_head: str = "lm_head.weight"  # "language_model.lm_head.weight"


@dataclasses.dataclass(frozen=True, eq=False)
class ImageEncoder:
    """A family's image encoder (Gemma 3's SigLIP tower and projector), as the loaders and the
    engine see it: ``config_from_hf(hf dict, *, dtype) -> config`` (a frozen dataclass with
    ``dtype`` and ``mm_tokens``); ``weight_specs(config)``; ``checkpoint_names(stored tensor
    names) -> {our path: (HF name, "", transpose)}`` (the layout the checkpoint was written in);
    ``encode(weights, pixels f32[B, C, S, S], *, cfg) -> [B, mm_tokens, D_text]``;
    ``expand(text, mm_tokens, boi, image, eoi) -> text``: a prompt as the family's processor
    writes it, each image marker (boi) grown into the image's soft tokens; ``markers``: the
    config.json keys of the (boi, image, eoi) token ids."""

    config_from_hf: Callable
    weight_specs: Callable
    checkpoint_names: Callable
    encode: Callable
    expand: Callable | None = None
    markers: tuple[str, str, str] = ("boi_token_index", "image_token_index", "eoi_token_index")


@dataclasses.dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class ModelFamily:
    """One model family, as the loaders, the engine and quantization see it.

    The forward pieces share the signatures of ``models.llama``:
    ``weight_specs(cfg) -> pytree of WeightSpec``; ``embed(weights, tokens i32[B, T], cfg) ->
    [B, T, D]``; ``decoder_layers(layers, x [B, T, D], positions i32[B, T], start, cache, *,
    cfg, first=0, read_cache=True) -> (x, cache)``; ``forward(weights, tokens, start, cache, *,
    cfg, read_cache=True, positions=None) -> (hidden [B, T, D], cache)``; ``unembed(weights, x,
    cfg) -> f32[B, T, V]``.
    """

    name: str  # ModelConfig.family of this family's configs
    weight_specs: Callable
    embed: Callable
    decoder_layers: Callable
    forward: Callable
    unembed: Callable
    checkpoint_names: CheckpointNames
    # Hugging Face checkpoints: config.json "architectures" this family loads, and its parser
    hf_architectures: frozenset[str] = frozenset()
    config_from_hf: Callable[..., ModelConfig] | None = None  # (hf dict, *, dtype) -> ModelConfig
    hf_activations: frozenset[str] = frozenset({"silu"})  # hidden_act values the MLP implements
    # a multimodal architecture -> the layouts of its text tower's tensors, in the order tried
    # (its config: text_config, or the outer config itself where there is none)
    hf_text_towers: Mapping[str, tuple[TextTower, ...]] = dataclasses.field(default_factory=dict)
    hf_skipped_prefixes: Callable[[dict], tuple[str, ...]] = _no_prefixes  # tensors the model does not run
    # weights stored otherwise than one tensor per name (gpt-oss: fused columns, MXFP4):
    # our name -> the tensors it is read from, and the reader (name, get) -> array
    hf_sources: Callable[[str], tuple[str, ...]] | None = None
    hf_read: Callable | None = None
    # GGUF files: general.architecture values and the parser
    gguf_architectures: frozenset[str] = frozenset()
    config_from_gguf: Callable[..., ModelConfig] | None = None  # (meta, tensor names, *, dtype, load_tensor)
    gguf_permuted_qk: frozenset[str] = frozenset()  # architectures whose Q/K rows llama.cpp permuted
    gguf_config_tensors: frozenset[str] = frozenset()  # tensors that configure rather than weigh
    # where several families list one GGUF architecture: whether this one claims a file (meta -> bool)
    gguf_claims: Callable[[dict], bool] | None = None
    gguf_tensor: Callable | None = None  # (name, array) -> array: undo a converter's rewrite
    # the family's own config dataclass (ModelConfig.family_config), None when it has none
    config_class: type | None = None
    # its layers run from the hidden state alone, so pipeline stages can split them
    pipeline_stages: bool = True
    # w8a8 can calibrate its layers one at a time from the hidden state
    w8a8_calibration: bool = True
    # its RMSNorms scale by (norm_offset + w): 1 for Gemma 2/3, whose weights hold w of 1 + w
    norm_offset: float = 0.0
    # multimodal architectures whose images it encodes -> the encoder (others' images are refused)
    image_encoders: Mapping[str, ImageEncoder] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "checkpoint_names", MappingProxyType(dict(self.checkpoint_names)))
        object.__setattr__(self, "hf_text_towers", MappingProxyType(dict(self.hf_text_towers)))
        if self.hf_architectures and self.config_from_hf is None:
            raise ValueError(f"family {self.name!r} lists HF architectures but no config_from_hf")
        if self.gguf_architectures and self.config_from_gguf is None:
            raise ValueError(f"family {self.name!r} lists GGUF architectures but no config_from_gguf")

    def num_params(self, cfg: ModelConfig) -> int:
        """Parameters of a model of config ``cfg``, counted from its weight declarations."""
        from jaxinfer.specs import is_spec

        total = 0
        for s in jax.tree.leaves(self.weight_specs(cfg), is_leaf=is_spec):
            n = 1
            for d in s.shape:
                n *= d
            total += n
        return total


@dataclasses.dataclass
class LayerAt:
    """Where one layer runs inside ``layer_loop``: what a family's layer function sees besides
    its weights, the hidden state and the cache."""

    cfg: ModelConfig
    i: int  # the model layer
    j: int  # its cache layer (a pipeline stage's pools hold its own layers from 0)
    positions: jax.Array  # i32[B, T]
    start: jax.Array | None  # i32[B]: position of each row's first new token
    read_cache: bool
    first: int  # the model layer of cache layer 0
    tables: dict  # rotary tables made so far in this pass, by (rotary config, dims)
    carry: dict  # what layers hand on to later ones in this pass (Gemma 4's shared keys/values)

    def rope(self, rope: RopeConfig | None = None, dim: int | None = None):
        """The (cos, sin) table of ``rope`` (default: this layer's) over ``dim`` head dims
        (default: head_dim) at this pass's positions, made once per pass."""
        rope = self.cfg.layer_rope(self.i) if rope is None else rope
        dim = self.cfg.head_dim if dim is None else dim
        if (rope, dim) not in self.tables:
            inv_freq = jnp.asarray(rope_inv_freq(dim, rope))
            self.tables[rope, dim] = rope_table(self.positions, inv_freq, rope.attention_factor)
        return self.tables[rope, dim]


def layer_loop(layer: Callable) -> Callable:
    """A family's ``decoder_layers`` from its one layer, ``layer(w, x [B, T, D], cache, at:
    LayerAt) -> (x, cache)``: the loop every family shares.

    decoder_layers(layers, x, positions i32[B, T], start, cache, *, cfg, first=0,
    read_cache=True, **carry) runs model layers first .. first + len(layers) - 1 (cache layer j
    holds model layer first + j) -> (x, cache); ``carry`` starts ``LayerAt.carry`` (Gemma 4's
    per-layer inputs)."""

    def decoder_layers(layers: list, x: jax.Array, positions: jax.Array, start, cache, *, cfg: ModelConfig,
                       first: int = 0, read_cache: bool = True, **carry):
        tables: dict = {}
        for j, w in enumerate(layers):
            at = LayerAt(cfg, first + j, j, positions, start, read_cache, first, tables, carry)
            x, cache = layer(w, x, cache, at)
        return x, cache

    return decoder_layers


def decoder(embed, decoder_layers):
    """A family's ``forward`` from its ``embed`` and ``decoder_layers``:

    forward(weights, tokens i32[B, T], start i32[B] (position of tokens[:, 0]), cache, *, cfg,
    read_cache=True (False when every row starts at 0: attend over the new tokens only),
    positions=None (i32[B, T] explicit positions, a packed step's; default start + t),
    embeds=None (or (index i32[B, T], rows [n, D]): a token whose index is >= 0 takes that
    row as its embedding instead of its token's, as an image's soft tokens do))
    -> (hidden [B, T, D] before the final norm, cache). With a cache, each layer first writes
    its new keys/values at their positions, then attends over the cache."""

    def forward(weights: dict, tokens: jax.Array, start: jax.Array, cache, *, cfg: ModelConfig,
                read_cache: bool = True, positions: jax.Array | None = None, embeds=None):
        if positions is None:
            positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = embed(weights, tokens, cfg)
        if embeds is not None:
            index, rows = embeds
            x = jnp.where((index >= 0)[..., None], rows[jnp.maximum(index, 0)].astype(x.dtype), x)
        return decoder_layers(weights["layers"], x, positions, start, cache, cfg=cfg, read_cache=read_cache)

    return forward
