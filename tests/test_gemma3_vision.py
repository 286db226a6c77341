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
