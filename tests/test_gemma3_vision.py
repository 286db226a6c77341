"""Gemma 3's image encoder (``models/siglip.py``) and preprocessing (``images.py``) against
transformers float32 on a tiny random Gemma3ForConditionalGeneration that transformers writes
itself: the pixels its PIL-backed image processor makes from ``preprocessor_config.json``, and the
soft tokens ``get_image_features`` gives (SigLIP tower, average pooling 2 x 2 patches per soft
token, the 1 + w RMSNorm, the projection)."""

import io

import numpy as np
import pytest

from tests import family_testing as ft
from tests.conftest import require

pytestmark = pytest.mark.reference

# 4 x 4 patches of 14 pixels pooled 2 x 2 into 4 soft tokens; two encoder layers
SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 56, "patch_size": 14}
TEXT = {"sliding_window": 8, "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def _images(n, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(37, 61), (56, 56), (120, 33), (9, 13), (64, 80)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    transformers = require("transformers")
    path = ft.write_tiny(tmp_path_factory.mktemp("g3v") / "ckpt", "gemma3", TEXT,
                         outer={"vision_config": SIGLIP, "mm_tokens_per_image": 4})
    transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}).save_pretrained(path)
    return path


def test_pixels_equal_the_processors(ckpt):
    transformers = require("transformers")
    from jaxinfer.images import ImageProcessor

    hf = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil.from_pretrained(ckpt)
    ours = ImageProcessor.from_dir(ckpt)
    for img in _images(4) + [_images(1)[0].convert("L"), _images(1)[0].convert("RGBA")]:
        want = np.asarray(hf(images=img, return_tensors="np")["pixel_values"][0])
        got = ours(img)
        assert got.shape == want.shape == (3, 56, 56) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_soft_tokens_equal_transformers(ckpt):
    torch = require("torch")
    transformers = require("transformers")
    from jaxinfer.images import ImageProcessor
    from jaxinfer.models import siglip

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    proc = ImageProcessor.from_dir(ckpt)
    pixels = np.stack([proc(img) for img in _images(3)])
    with torch.no_grad():
        want = model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    from jaxinfer.loaders.hf import load_image_encoder

    cfg, weights = load_image_encoder(ckpt, dtype="float32")
    assert (cfg.mm_tokens, cfg.text_d_model, cfg.patches_per_side) == (4, ft.COMMON["hidden_size"], 4)
    got = np.asarray(siglip.encode_images(weights, pixels, cfg=cfg))
    assert want.shape == got.shape == (3, 4, ft.COMMON["hidden_size"]) and np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    # attention 4 queries at a time (the published 4,096 patches go 512 at a time)
    siglip.QUERY_BLOCK, block = 4, siglip.QUERY_BLOCK
    try:
        np.testing.assert_allclose(np.asarray(siglip.encode(weights, pixels, cfg=cfg)), want, rtol=0, atol=1e-4)
    finally:
        siglip.QUERY_BLOCK = block
    # padded into a bucket of 4 or encoded alone: each image's tokens are its own
    for i in range(3):
        np.testing.assert_allclose(np.asarray(siglip.encode_images(weights, pixels[i:i + 1], cfg=cfg))[0], got[i],
                                   rtol=0, atol=1e-5)


def test_every_tensor_of_the_tower_is_declared_and_read(ckpt):
    """Each vision tower and projector tensor the checkpoint carries (but the pooling head,
    which Gemma 3 never runs) maps to one declared weight."""
    import jax
    from safetensors import safe_open

    from jaxinfer.models import siglip
    from jaxinfer.specs import is_spec

    with safe_open(ckpt / "model.safetensors", "np") as f:
        stored = {n for n in f.keys() if n.startswith(("vision_tower.", "multi_modal_projector."))
                  and not n.startswith("vision_tower.head.")}
    cfg = siglip.config_from_hf(__import__("json").loads((ckpt / "config.json").read_text()), dtype="float32")
    n_specs = len(jax.tree.leaves(siglip.weight_specs(cfg), is_leaf=is_spec))
    assert n_specs == len(stored)


@pytest.mark.parametrize("data, match", [
    (b"not an image at all", "not an image"),
    (None, "corrupt image"),  # a PNG cut short
    (b"", "not an image"),
])
def test_bad_images_get_one_line(data, match):
    from jaxinfer.images import ImageError, open_image

    if data is None:
        buf = io.BytesIO()
        _images(1)[0].save(buf, format="PNG")
        data = buf.getvalue()[:60]
    with pytest.raises(ImageError, match=match) as e:
        open_image(data)
    assert "\n" not in str(e.value)


def test_an_oversized_image_is_refused(monkeypatch):
    from jaxinfer import images

    buf = io.BytesIO()
    _images(1)[0].save(buf, format="PNG")
    monkeypatch.setattr(images, "MAX_PIXELS", 100)
    with pytest.raises(images.ImageError, match="larger than 100 pixels"):
        images.open_image(buf.getvalue())


# the tiny checkpoint's image markers: in-vocabulary ids (the published ones are 255999,
# 262144 and 256000 of 262208)
BOI, IMG, EOI = 93, 95, 94
MARKERS = {"image_token_index": IMG, "boi_token_index": BOI, "eoi_token_index": EOI}
T_PAD = 48  # every dense forward below runs at this length (right padding is never seen)


def write_multimodal(path):
    """A tiny random Gemma3ForConditionalGeneration at ``path`` (with its
    preprocessor_config.json) -> (path, its transformers float32 model)."""
    torch = require("torch")
    transformers = require("transformers")
    path = ft.write_tiny(path, "gemma3", TEXT, outer={"vision_config": SIGLIP, "mm_tokens_per_image": 4} | MARKERS)
    transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}).save_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    return path, ref


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration with in-vocabulary image markers, its reference
    model and jaxinfer's text weights and image encoder."""
    from jaxinfer.loaders.hf import load_hf, load_image_encoder

    path, ref = write_multimodal(tmp_path_factory.mktemp("g3mm") / "ckpt")
    text = load_hf(path, dtype="float32")
    vcfg, vweights = load_image_encoder(path, dtype="float32")
    return path, ref, text, vcfg, vweights


def _prompt(rng, n_images):
    """bos, text, then per image <start_of_image> 4 x image token <end_of_image> and more text."""
    ids = [1] + [int(t) for t in rng.integers(4, 90, rng.integers(1, 4))]
    for _ in range(n_images):
        ids += [BOI] + [IMG] * 4 + [EOI] + [int(t) for t in rng.integers(4, 90, rng.integers(2, 5))]
    return ids


def _reference(ref, ids, pixels, steps=0):
    """transformers' log-softmax over the prompt, and its greedy tokens (full forward each step)."""
    torch = require("torch")
    ids = list(ids)
    kw = {"pixel_values": torch.from_numpy(pixels)} if len(pixels) else {}
    with torch.no_grad():
        def logits(ids):
            t = torch.tensor([ids])
            return ref(t, token_type_ids=(t == IMG).long(), **kw).logits[0].double()
        lp = torch.log_softmax(logits(ids), -1).numpy()
        toks, margins = [], []
        for _ in range(steps):
            top = torch.topk(logits(ids)[-1], 2)
            toks.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(toks[-1])
    return lp, toks, margins


def _ours(mm, rows, pixels):
    """jaxinfer's log-softmax of each row of one batched dense forward with images."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models import gemma3, siglip

    _, _, text, vcfg, vweights = mm
    soft = siglip.encode_images(vweights, pixels, cfg=vcfg) if len(pixels) else jnp.zeros((1, 4, text.cfg.d_model))
    tokens = jnp.asarray([r + [0] * (T_PAD - len(r)) for r in rows], jnp.int32)

    @jax.jit
    def run(w, tokens, soft):
        h, _ = gemma3.forward_with_images(w, tokens, soft, jnp.zeros(tokens.shape[0], jnp.int32), None,
                                          cfg=text.cfg, image_token=IMG)
        return jax.nn.log_softmax(gemma3.unembed(w, h, text.cfg), -1)

    lp = np.asarray(run(text.weights, tokens, soft))
    return [lp[i, :len(r)] for i, r in enumerate(rows)]


def _text_positions(ids):
    """Positions whose next token is text (not an image's soft token): where log-probs mean something."""
    return [t for t in range(len(ids) - 1) if ids[t + 1] != IMG]


def test_logprobs_and_greedy_tokens_with_an_image_equal_transformers(mm):
    from jaxinfer.images import ImageProcessor

    path = mm[0]
    proc = ImageProcessor.from_dir(path)
    rng = np.random.default_rng(3)
    ids = _prompt(rng, 1)
    pixels = np.stack([proc(_images(1)[0])])
    want, toks, margins = _reference(mm[1], ids, pixels, steps=6)
    got = _ours(mm, [ids], pixels)[0]
    pos = _text_positions(ids)
    after = [t for t in pos if t > ids.index(EOI)]
    assert after, "the prompt has text after the image"
    np.testing.assert_allclose([got[t, ids[t + 1]] for t in pos], [want[t, ids[t + 1]] for t in pos],
                               rtol=0, atol=ft.PLP_ATOL)
    # greedy: each step the full forward of the prompt so far
    seq = list(ids)
    for step, (tok, margin) in enumerate(zip(toks, margins)):
        if margin < ft.NEAR_TIE:
            break
        mine = int(np.argmax(_ours(mm, [seq], pixels)[0][-1]))
        assert mine == tok, f"step {step}: {mine}, transformers {tok}"
        seq.append(mine)


def test_image_tokens_attend_to_their_whole_image_only():
    """Worked by hand: an image's soft tokens see up to their image's last one; text tokens
    (markers included) and a second image's tokens keep their own limits."""
    import jax.numpy as jnp

    from jaxinfer.models import gemma3

    tokens = jnp.asarray([[1, 5, BOI, IMG, IMG, IMG, EOI, 7, IMG, IMG, 9]], jnp.int32)
    pos = jnp.arange(11, dtype=jnp.int32)[None]
    assert gemma3.image_attend_to(tokens, pos, IMG).tolist() == [[0, 1, 2, 5, 5, 5, 6, 7, 9, 9, 10]]


def test_a_batch_of_eight_prompts_with_0_to_2_images_equals_each_alone_and_transformers(mm):
    from jaxinfer.images import ImageProcessor

    proc = ImageProcessor.from_dir(mm[0])
    rng = np.random.default_rng(5)
    counts = [0, 1, 2, 1, 0, 2, 1, 1]
    rows = [_prompt(rng, n) for n in counts]
    imgs = _images(sum(counts), seed=9)
    pixels = np.stack([proc(i) for i in imgs])
    batched = _ours(mm, rows, pixels)
    first = 0
    for ids, n, got in zip(rows, counts, batched):
        mine = pixels[first:first + n]
        first += n
        want = _reference(mm[1], ids, mine)[0]
        pos = _text_positions(ids)
        np.testing.assert_allclose([got[t, ids[t + 1]] for t in pos], [want[t, ids[t + 1]] for t in pos],
                                   rtol=0, atol=ft.PLP_ATOL)
        alone = _ours(mm, [ids], mine)[0]
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)


def test_prompt_text_as_the_processor_writes_it():
    from jaxinfer.models import gemma3

    got = gemma3.expand_images("<start_of_turn>user\nA<start_of_image>B<start_of_image>", 2)
    one = "\n\n<start_of_image><image_soft_token><image_soft_token><end_of_image>\n\n"
    assert got == f"<start_of_turn>user\nA{one}B{one}"


def test_prefill_with_images_into_a_cache_then_decode_equals_the_full_forward(mm):
    """A prompt with two images prefilled into a dense KV cache (the image tokens' bidirectional
    attention written to it), then decoded a token at a time with the plain forward: each step
    equals the full forward of the sequence so far, images included (read off one full forward
    of the whole sequence: causal, so each position sees what it saw then)."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import cache as kv
    from jaxinfer.images import ImageProcessor
    from jaxinfer.models import gemma3, siglip

    _, _, text, vcfg, vweights = mm
    cfg, w = text.cfg, text.weights
    proc = ImageProcessor.from_dir(mm[0])
    ids = _prompt(np.random.default_rng(11), 2)
    soft = siglip.encode_images(vweights, np.stack([proc(i) for i in _images(2, seed=4)]), cfg=vcfg)
    full = jax.jit(lambda w, seq, soft: gemma3.unembed(w, gemma3.forward_with_images(
        w, seq, soft, jnp.zeros(1, jnp.int32), None, cfg=cfg, image_token=IMG)[0], cfg))
    cache = kv.init_cache(cfg, 1, T_PAD)
    h, cache = jax.jit(lambda w, t, soft, c: gemma3.forward_with_images(
        w, t, soft, jnp.zeros(1, jnp.int32), c, cfg=cfg, image_token=IMG, read_cache=False))(
        w, jnp.asarray([ids]), soft, cache)
    logits = [np.asarray(gemma3.unembed(w, h, cfg))[0]]
    seq = list(ids)
    step = jax.jit(lambda w, t, s, c: gemma3.forward(w, t, s, c, cfg=cfg))
    for _ in range(4):
        seq.append(int(np.argmax(logits[-1][-1])))
        h, cache = step(w, jnp.asarray([[seq[-1]]]), jnp.asarray([len(seq) - 1], jnp.int32), cache)
        logits.append(np.asarray(gemma3.unembed(w, h, cfg))[0])
    np.testing.assert_allclose(np.concatenate(logits), np.asarray(full(w, jnp.asarray([seq]), soft))[0],
                               rtol=0, atol=1e-4)
