"""Images through the paged engine (``engine.multimodal``) on the tiny random
Gemma3ForConditionalGeneration of ``test_gemma3_vision``, against transformers float32: the
log-probs of the text after each image and the greedy tokens; a batch of 8 prompts with 0-2
images each, chunked and packed together, equal to each alone; each image encoded once per
request, preemption included; the prefix cache naming an image's pages by the image."""

import numpy as np
import pytest

from tests import family_testing as ft
from tests.test_gemma3_vision import IMG, _images, _prompt, _reference, _text_positions, write_multimodal

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint (with its preprocessor_config.json) and its transformers float32 model."""
    return write_multimodal(tmp_path_factory.mktemp("g3img") / "ckpt")


def _llm(path, **kw):
    from jaxinfer import LLM

    opts = dict(max_model_len=96, progress=False, max_num_seqs=8, block_size=4, max_num_batched_tokens=16,
                num_gpu_blocks_override=256)
    return LLM(str(path), dtype="float32", **(opts | kw))


def _sp(max_tokens=5, plp=True, **kw):
    from jaxinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          prompt_logprobs=0 if plp else None, **kw)


def _run(llm, prompts, images, **kw):
    reqs = [{"prompt_token_ids": p} | ({"multi_modal_data": {"image": im}} if im else {})
            for p, im in zip(prompts, images)]
    return ft.outputs_of(llm.generate(reqs, _sp(**kw), use_tqdm=False))


def _check_against_transformers(ref, ids, imgs, got, proc):
    pixels = np.stack([proc(i) for i in imgs]) if imgs else np.zeros((0, 3, 56, 56), np.float32)
    want, toks, margins = _reference(ref, ids, pixels, steps=len(got["tokens"]))
    pos = _text_positions(ids)
    np.testing.assert_allclose([got["prompt_logprobs"][t] for t in pos], [want[t, ids[t + 1]] for t in pos],
                               rtol=0, atol=ft.PLP_ATOL)
    for step, (mine, tok, margin) in enumerate(zip(got["tokens"], toks, margins)):
        assert mine == tok, f"step {step}: {mine}, transformers {tok}"
        if margin < ft.NEAR_TIE:
            break


def test_one_prompt_with_two_images_equals_transformers(ckpt):
    from jaxinfer.images import ImageProcessor

    path, ref = ckpt
    llm = _llm(path)
    ids = _prompt(np.random.default_rng(3), 2)
    imgs = _images(2, seed=1)
    (got,) = _run(llm, [ids], [imgs])
    _check_against_transformers(ref, ids, imgs, got, ImageProcessor.from_dir(path))
    assert llm.engine.images.stats == {"images_encoded": 2, "encoder_calls": 1}


def test_a_batch_of_eight_with_0_to_2_images_equals_each_alone_and_transformers(ckpt):
    """Prefill chunks of 16 tokens: prompts are cut between images and packed with others'."""
    from jaxinfer.images import ImageProcessor

    path, ref = ckpt
    proc = ImageProcessor.from_dir(path)
    rng = np.random.default_rng(5)
    counts = [0, 1, 2, 1, 0, 2, 1, 1]
    prompts = [_prompt(rng, n) for n in counts]
    pool = iter(_images(sum(counts), seed=9))
    images = [[next(pool) for _ in range(n)] for n in counts]
    llm = _llm(path)
    batched = _run(llm, prompts, images)
    assert llm.engine.images.stats["images_encoded"] == sum(counts)
    for ids, imgs, got in zip(prompts, images, batched):
        (alone,) = _run(llm, [ids], [imgs])
        assert alone["tokens"] == got["tokens"]
        np.testing.assert_allclose(alone["prompt_logprobs"], got["prompt_logprobs"], rtol=0, atol=1e-5)
        _check_against_transformers(ref, ids, imgs, got, proc)


def test_text_rows_do_no_image_work(ckpt):
    """Text-only prompts on a model with an image encoder: no encoder call, and every step
    the executable a text-only step runs (no image arrays on the batch)."""
    path, ref = ckpt
    llm = _llm(path)
    prompts = [_prompt(np.random.default_rng(s), 0) for s in range(3)]
    built = []
    build = llm.engine.build
    llm.engine.build = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    got = _run(llm, prompts, [None] * 3, plp=False)
    assert llm.engine.images.stats["encoder_calls"] == 0
    assert built and all(b.image_index is None and b.attend_to is None for b in built)
    assert [g["tokens"] for g in got] == [ft.model_outputs(ref, [p], 5)[0]["tokens"] for p in prompts]


def test_an_image_is_encoded_once_across_preemption(ckpt):
    """A pool too small for every row at once preempts rows; the preempted ones are recomputed
    from their prompts without encoding their images again, to the same tokens."""
    path, _ = ckpt
    rng = np.random.default_rng(8)
    prompts = [_prompt(rng, 1) for _ in range(6)]
    images = [[im] for im in _images(6, seed=2)]
    want = _run(_llm(path), prompts, images, max_tokens=24, plp=False)
    llm = _llm(path, num_gpu_blocks_override=28, enable_prefix_caching=False)
    got = llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)],
                       _sp(max_tokens=24, plp=False), use_tqdm=False)
    assert llm.engine.sched.stats["preemptions"] > 0
    assert llm.engine.images.stats["images_encoded"] == 6
    assert [list(o.outputs[0].token_ids) for o in got] == [w["tokens"] for w in want]


def test_the_prefix_cache_shares_pages_for_the_same_image_only(ckpt):
    """Two prompts with equal ids and the same image share their pages; with another image
    they share only the pages before the image; each output equals its own run without a cache."""
    path, _ = ckpt
    ids = [1] + list(range(10, 22)) + [93] + [IMG] * 4 + [94] + list(range(30, 42))  # the image at 13..18
    a, b = _images(2, seed=6)
    llm = _llm(path)
    cold = _llm(path, enable_prefix_caching=False)
    stats = llm.engine.sched.stats

    def run(llm, image):  # greedy tokens and their summed log-prob
        (o,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                            _sp(plp=False, logprobs=0), use_tqdm=False)
        return o.outputs[0].token_ids, o.outputs[0].cumulative_logprob

    first = run(llm, a)
    assert stats["cached_prompt_tokens"] == 0
    same = run(llm, a)
    assert stats["cached_prompt_tokens"] == 28  # every full page of the 31-token prompt
    other = run(llm, b)
    assert stats["cached_prompt_tokens"] == 28 + 12  # the 3 pages before the image's first token
    for got, want in ((first, run(cold, a)), (same, run(cold, a)), (other, run(cold, b))):
        assert list(got[0]) == list(want[0]) and got[1] == pytest.approx(want[1], abs=1e-5)
    assert abs(other[1] - first[1]) > 1e-3  # the image is seen
    # the second request found every page of its image cached: its image was never encoded
    assert llm.engine.images.stats["images_encoded"] == 2


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_row_image_mask_equals_the_attention_reference(monkeypatch, window):
    """The prefill row's XLA reader with attend_to (an image's tokens see their whole image,
    here across query blocks of 4) against ``layers.attention`` on each segment alone."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.models import packed
    from jaxinfer.models.layers import attention

    monkeypatch.setattr(packed, "PREFILL_QUERY_BLOCK", 4)
    T, N, K, H, ps = 24, 4, 2, 8, 4
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (1, T, N, H))
    k = jax.random.normal(kk, (1, T, K, H))
    v = jax.random.normal(kv, (1, T, K, H))
    seg = np.array([0] * 11 + [1] * 10 + [-1] * 3, np.int32)
    pos = np.concatenate([np.arange(11), np.arange(10), np.zeros(3)]).astype(np.int32)
    to = pos.copy()
    to[2:7] = 6  # segment 0: an image at positions 2..6 (query blocks 0 and 1)
    to[11 + 3:11 + 9] = 8  # segment 1: an image at positions 3..8 (blocks 3 and 4)
    kpool, vpool = jnp.zeros((4, K, H, ps)), jnp.zeros((4, K, ps, H))
    got = packed.prefill_row_attention(q, k, v, jnp.asarray(pos), jnp.asarray(seg), kpool, vpool,
                                       jnp.zeros((1, 2), jnp.int32), None, jnp.int32(0), jnp.asarray(to),
                                       scale=H ** -0.5, window=window)
    for lo, hi in ((0, 11), (11, 21)):
        p = jnp.asarray(pos[lo:hi])[None]
        want = attention(q[:, lo:hi], k[:, lo:hi].transpose(0, 2, 3, 1), v[:, lo:hi].transpose(0, 2, 1, 3), p, p[0],
                         scale=H ** -0.5, window=window, attend_to=jnp.asarray(to[lo:hi])[None])
        np.testing.assert_allclose(np.asarray(got[:, lo:hi]), np.asarray(want), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_with_pallas_kernels_image_steps_read_with_the_reference(ckpt, monkeypatch):
    """Pallas kernels (interpret mode on CPU): the ragged kernel has no image mask, so in a step
    with image tokens the prefill row reads its pages with XLA's reader while the decode rows
    beside it keep the decode kernel; the results equal transformers."""
    from jaxinfer.images import ImageProcessor
    from jaxinfer.models import packed

    traced = []
    decode_kernel = packed.decode_kernel_attention
    monkeypatch.setattr(packed, "decode_kernel_attention", lambda q, *a, **k: traced.append(a[2].attend_to is not None) or
                        decode_kernel(q, *a, **k))
    path, ref = ckpt
    llm = _llm(path, kernels="pallas", block_size=8)  # pages the kernels tile (f32: multiples of 8)
    rng = np.random.default_rng(3)
    prompts = [_prompt(rng, 0), _prompt(rng, 2), _prompt(rng, 1)]
    images = [None, _images(2, seed=1), _images(1, seed=5)]
    built = []
    build = llm.engine.build
    llm.engine.build = lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    got = _run(llm, prompts, images, max_tokens=3)
    assert any(b.rows and b.attend_to is not None for b in built)  # decode rows beside an image's prefill
    assert any(traced)  # traced with the decode kernel beside an image's prefill row
    proc = ImageProcessor.from_dir(path)
    for ids, imgs, g in zip(prompts, images, got):
        _check_against_transformers(ref, ids, imgs or [], g, proc)


def test_images_with_speculative_decoding_are_refused(ckpt):
    from jaxinfer.errors import InvalidRequest

    llm = _llm(ckpt[0], speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidRequest, match="image inputs are not supported with .*speculative decoding"):
        _run(llm, [_prompt(np.random.default_rng(1), 1)], [_images(1)])


def test_without_its_preprocessor_config_images_are_refused_saying_so(ckpt, tmp_path):
    """A multimodal checkpoint copied without preprocessor_config.json loads; an image, in a
    prompt or a chat, is refused with the file it lacks, not "no image encoder"."""
    import shutil

    from jaxinfer.errors import InvalidRequest

    path = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], path, ignore=shutil.ignore_patterns("preprocessor_config.json"))
    llm = _llm(path)
    assert llm.engine.images is None
    with pytest.raises(InvalidRequest, match="prompt 0: this model takes no images .*no preprocessor_config.json"):
        _run(llm, [_prompt(np.random.default_rng(1), 1)], [_images(1)])
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(InvalidRequest, match="conversation 0: .*no preprocessor_config.json") as e:
        llm.chat(chat, use_tqdm=False)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_after_warm_up_image_requests_compile_nothing(ckpt):
    """Warm-up builds the encoder for each image bucket and each prefill step's image variant:
    prompts with one or two images, chunked and packed with text prompts, then build no
    executable. With images not allowed (limit_mm_per_prompt 0) warm-up leaves them out."""
    from jaxinfer.engine import multimodal, warmup

    path, _ = ckpt
    rng = np.random.default_rng(12)
    counts = [1, 0, 2, 1, 0]
    prompts = [_prompt(rng, n) for n in counts]
    pool = iter(_images(sum(counts), seed=3))
    images = [[next(pool) for _ in range(n)] for n in counts]
    small = dict(max_num_seqs=2, block_size=16, num_gpu_blocks_override=32)
    assert not warmup.takes_images(_llm(path, limit_mm_per_prompt={"image": 0}, **small).engine)
    llm = _llm(path, **small)
    assert warmup.takes_images(llm.engine)
    llm.engine.warmup(max_prompt_len=32, max_len=40)
    assert llm.engine.images.num_compilations() == len(multimodal.ENCODE_BUCKETS)
    assert {(b.rows, b.prefill_len) for b in _image_steps(llm)} == {(0, 16), (1, 16), (2, 16)}
    before = llm.engine.num_compilations()
    _run(llm, prompts, images, plp=False)
    assert llm.engine.images.stats["images_encoded"] == sum(counts)
    assert llm.engine.num_compilations() == before


def _image_steps(llm):
    from jaxinfer.engine import warmup

    eng = llm.engine
    shapes = warmup.warmup_shapes(eng, 32, 40)
    return [job[1][1].batch for _, job in warmup.image_runs(eng, shapes, [0])]
