"""Images in the paged engine: a prompt's images encoded once, their soft tokens put into the
packed step's token embeddings, and their tokens attending bidirectionally within each image.

A request with images carries ``PromptImages`` on its rows (one object shared by a request's
samples): where each image's soft tokens lie in the prompt (a run of the checkpoint's image
token), a hash of each image, and its pixels until they are encoded. The first step whose
prefill row reaches a prompt's images encodes every image waiting in that step in one jitted
call, padded to ``ENCODE_BUCKETS`` images (``ImageInputs.encode``); the soft tokens then stay
on the host with the request, so a preempted request is recomputed without encoding again.

Each step that holds image tokens carries them on its ``PackedBatch`` (``attach``): the soft
tokens of just those tokens ([Tp, D], as many rows as the prefill row has tokens, so a step
shape has one image variant and warm-up can build each), each token's row in them, and for the
prefill row the last position each token sees (an image's last token for an image's, its own for the
rest). The scheduler never cuts an image's tokens across prefill chunks (``cut``), so that
block lies inside one prefill row. A step without image tokens carries none of this and runs
the executable a text-only engine runs; its text rows do no image work.

Prefix caching names an image's tokens by the image's hash (``PromptImages.hash_tokens``):
prompts with the same image share its pages, prompts with different ones never do.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.compiles import CompileCounter
from jaxinfer.errors import InvalidRequest
from jaxinfer.models.packed import PackedBatch

ENCODE_BUCKETS = (1, 2, 4, 8)  # images encoded in one call, padded up to the next of these


@dataclasses.dataclass(eq=False)
class PromptImages:
    """A prompt's images, in prompt order."""

    spans: list[tuple[int, int]]  # (first prompt index, number of soft tokens) of each image
    digests: list[bytes]  # a hash of each image's pixels (16 bytes)
    pixels: np.ndarray | None  # f32[I, C, S, S] until encoded, then None
    embeds: np.ndarray | None = None  # [I, M, D] the soft tokens, once encoded (kept across preemption)
    encodes: int = 0  # encoder calls that took these images (1 once encoded)

    def hash_tokens(self, tokens: list[int]) -> list[int]:
        """tokens with each image's soft tokens replaced by values derived from the image's hash
        (negative, so never a text token's id), for naming pages in the prefix cache."""
        out = list(tokens)
        for (s, n), d in zip(self.spans, self.digests):
            h = int.from_bytes(d[:8], "little") >> 2
            out[s : s + n] = [-1 - ((h + j) & ((1 << 62) - 1)) for j in range(n)]
        return out

    def cut(self, start: int, n: int) -> int:
        """The most tokens of [start, start + n) a prefill chunk may take without ending inside
        an image (0: none now; the image needs a chunk of its own length)."""
        end = start + n
        for s, m in self.spans:
            if s < end < s + m:
                return max(0, s - start)
        return n


def image_digest(pixels: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(pixels, np.float32).tobytes(), digest_size=16).digest()


def find_spans(tokens: list[int], image_token: int, mm_tokens: int, n_images: int, what: str) -> list[tuple[int, int]]:
    """Each image's run of ``mm_tokens`` image tokens in a prompt, which must hold exactly
    ``n_images`` of them and not end inside one (its last token is the first one decoded)."""
    a = np.asarray(tokens) == image_token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], a.astype(np.int8), [0]])))
    runs = [(int(s), int(e - s)) for s, e in zip(edges[::2], edges[1::2])]
    if len(runs) != n_images or any(m != mm_tokens for _, m in runs):
        raise InvalidRequest(f"{what}: {n_images} image(s) need {n_images} run(s) of {mm_tokens} image tokens "
                             f"(id {image_token}) in the prompt, found runs of {[m for _, m in runs]}")
    if runs and a[-1]:
        raise InvalidRequest(f"{what}: the prompt must not end with an image's tokens")
    return runs


class ImageInputs:
    """A checkpoint's image encoder as the engine runs it: preprocessing, the jitted bucketed
    encoder call, and the per-step arrays of ``attach``.

    encoder: the family's ``models.family.ImageEncoder``; cfg, weights: its config and weights
    (``loaders.hf.load_image_encoder``); processor: ``images.ImageProcessor``; image_token:
    the prompt's soft-token id; markers: the tokenizer's spelling of the (boi, image, eoi)
    tokens; boi marks an image in prompt text (Gemma 3's ``<start_of_image>``)."""

    def __init__(self, encoder, cfg, weights, processor, *, image_token: int, markers: tuple[str, str, str]):
        self.encoder, self.cfg, self.weights, self.processor = encoder, cfg, weights, processor
        self.image_token, self.markers = image_token, markers
        self.boi = markers[0]
        self.mm_tokens = cfg.mm_tokens
        self.limit: int | None = None  # images one prompt may hold (limit_mm_per_prompt; None: any)
        self._compiles = CompileCounter()
        self._encode = self._compiles.counted(jax.jit(functools.partial(encoder.encode, cfg=cfg)))
        self.stats = {"images_encoded": 0, "encoder_calls": 0}

    def num_compilations(self) -> int:
        """Executables the encoder's jitted call has built (one per ENCODE_BUCKETS size met)."""
        return self._compiles.count

    @functools.cached_property
    def soft_tokens(self) -> jax.ShapeDtypeStruct:
        """The shape and dtype of one image's soft tokens, [M, D]."""
        px = jax.ShapeDtypeStruct((1, 3, self.processor.height, self.processor.width), jnp.float32)
        out = jax.eval_shape(functools.partial(self.encoder.encode, cfg=self.cfg), self.weights, px)
        return jax.ShapeDtypeStruct(out.shape[1:], out.dtype)

    # ------------------------------------------------------------------ warm-up
    def warm_encoder(self) -> None:
        """Build the encoder's executable for each of ENCODE_BUCKETS (a step's images from many
        prompts, each of which may start its prefill partway into an image, can need any)."""
        for b in ENCODE_BUCKETS:
            px = jnp.zeros((b, 3, self.processor.height, self.processor.width), jnp.float32)
            jax.block_until_ready(self._encode(self.weights, px))

    def idle(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` (with a prefill row) in the shape ``attach`` gives a step with images, but
        with no token an image's: warm-up runs it to build that executable."""
        Tp, soft = batch.prefill_len, self.soft_tokens
        return dataclasses.replace(batch, image_embeds=np.zeros((Tp, soft.shape[-1]), soft.dtype),
                                   image_index=np.full(batch.tokens.shape[0], -1, np.int32),
                                   attend_to=np.asarray(batch.positions)[batch.rows * batch.q:].copy())

    # ------------------------------------------------------------------ requests
    def pixels(self, images, what: str) -> np.ndarray:
        """f32[I, C, S, S] of PIL images or encoded bytes; InvalidRequest naming the bad one."""
        from jaxinfer.images import ImageError

        out = []
        for k, img in enumerate(images):
            try:
                out.append(self.processor(img))
            except ImageError as e:
                raise InvalidRequest(f"{what}: image {k}: {e}") from None
        return np.stack(out)

    def expand(self, text: str) -> str:
        """Prompt text with each image marker grown into its image's soft tokens."""
        return self.encoder.expand(text, self.mm_tokens, *self.markers)

    def prompt_images(self, tokens: list[int], images, what: str) -> PromptImages:
        """The PromptImages of a prompt whose tokens already hold each image's soft tokens."""
        px = self.pixels(images, what)
        spans = find_spans(tokens, self.image_token, self.mm_tokens, len(px), what)
        return PromptImages(spans, [image_digest(p) for p in px], px)

    def check(self, images: PromptImages, prefill_chunk: int) -> None:
        if self.mm_tokens > prefill_chunk:
            raise InvalidRequest(f"an image takes {self.mm_tokens} tokens, which must fit one prefill chunk: raise "
                                 f"max_num_batched_tokens (now {prefill_chunk}) to at least {self.mm_tokens}")

    # ------------------------------------------------------------------ steps
    def encode(self, pending: list[PromptImages]) -> None:
        """Encode every image of ``pending`` (not yet encoded) in calls of up to
        ENCODE_BUCKETS[-1] images, padded to a bucket; each keeps its soft tokens on the host."""
        pixels = np.concatenate([p.pixels for p in pending])
        out = []
        for i in range(0, len(pixels), ENCODE_BUCKETS[-1]):
            part = pixels[i : i + ENCODE_BUCKETS[-1]]
            b = next(b for b in ENCODE_BUCKETS if b >= len(part))
            padded = np.concatenate([part, np.zeros((b - len(part), *part.shape[1:]), part.dtype)])
            out.append(np.asarray(self._encode(self.weights, jnp.asarray(padded)))[: len(part)])
            self.stats["encoder_calls"] += 1
        soft = np.concatenate(out)
        first = 0
        for p in pending:
            p.embeds, p.pixels = soft[first : first + len(p.spans)], None
            p.encodes += 1
            first += len(p.spans)
        self.stats["images_encoded"] += len(soft)

    def attach(self, batch: PackedBatch, plan) -> PackedBatch:
        """``batch`` (built from ``plan``) with the image arrays of its prefill row's image
        tokens, encoding the images first reached in this step; unchanged when it has none."""
        R, Q = batch.rows, batch.q
        hits = []  # (row index in the step, PromptImages, image, offset in the image)
        at = R * Q
        for g in plan.prefill:
            imgs = g.seq.row.images
            if imgs is not None:
                for k, (s, m) in enumerate(imgs.spans):
                    for p in range(max(s, g.start), min(s + m, g.start + g.n)):
                        hits.append((at + p - g.start, imgs, k, p - s))
            at += g.n
        if not hits:
            return batch
        pending = list({id(h[1]): h[1] for h in hits if h[1].embeds is None}.values())
        if pending:
            self.encode(pending)
        N, Tp = batch.tokens.shape[0], batch.prefill_len
        rows = np.zeros((Tp, hits[0][1].embeds.shape[-1]), hits[0][1].embeds.dtype)
        index = np.full(N, -1, np.int32)
        positions = np.asarray(batch.positions)
        attend_to = positions[R * Q :].copy()
        for r, (i, imgs, k, j) in enumerate(hits):
            rows[r] = imgs.embeds[k, j]
            index[i] = r
            s, m = imgs.spans[k]
            attend_to[i - R * Q] = s + m - 1
        assert attend_to.shape == (Tp,)
        return dataclasses.replace(batch, image_embeds=rows, image_index=index, attend_to=attend_to)


NO_ENCODER = "its checkpoint has no image encoder jaxinfer runs"


def load(path, tokenizer, *, dtype: str) -> tuple[ImageInputs | None, str | None]:
    """(the ImageInputs, None) of a Hugging Face checkpoint directory whose family encodes its
    images, or (None, why its images are refused: ``NO_ENCODER``, or what the checkpoint lacks)."""
    from pathlib import Path

    from jaxinfer.images import ImageProcessor
    from jaxinfer.loaders.hf import image_encoder_of, load_image_encoder

    path = Path(path)
    if not (path / "config.json").is_file():
        return None, NO_ENCODER
    encoder, hf = image_encoder_of(path)
    if encoder is None or encoder.expand is None:
        return None, NO_ENCODER
    if not (path / "preprocessor_config.json").is_file():
        return None, (f"its checkpoint has an image encoder but no preprocessor_config.json, which says how its "
                      f"images are resized and normalised: copy that file from the model's repository into {path}")
    ids = [hf.get(k) for k in encoder.markers]
    if any(not isinstance(i, int) for i in ids):
        return None, f"its config.json does not give the image marker token ids {', '.join(encoder.markers)}"
    cfg, weights = load_image_encoder(path, dtype=dtype)
    markers = tuple(tokenizer.id_to_piece(i) for i in ids)
    return ImageInputs(encoder, cfg, weights, ImageProcessor.from_dir(path), image_token=ids[1],
                       markers=markers), None


def refusal(engine) -> str | None:
    """Why ``engine`` runs no image request at all, or None where it runs them."""
    if engine.images is None:
        return f"this model takes no images ({NO_ENCODER})"
    if engine.D > 1 or engine.pipeline is not None or engine.spec is not None:
        return ("image inputs are not supported with data_parallel_size > 1, pipeline parallelism "
                "or speculative decoding")
    return None


def validate(engine, images: PromptImages) -> None:
    """Raise InvalidRequest if a row with these images can never run on ``engine``."""
    reason = refusal(engine)
    if reason is not None:
        raise InvalidRequest(reason)
    engine.images.check(images, engine.config.max_num_batched_tokens)


class ImagePrompt(list):
    """A prompt's token ids (a list of ints) that also carries its images (``images``: a
    PromptImages), so they travel wherever a prompt's ids do, to the rows made from them."""

    def __init__(self, ids, images: PromptImages):
        super().__init__(ids)
        self.images = images


def limit_images(n: int, limit: dict | None, what: str) -> None:
    """vLLM's ``limit_mm_per_prompt`` ({"image": k}): more than k images in one prompt is refused."""
    k = (limit or {}).get("image")
    if k is not None and n > k:
        raise InvalidRequest(f"{what}: at most {k} image(s) may be provided in one prompt (limit_mm_per_prompt), "
                             f"got {n}")
