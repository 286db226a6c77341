"""Images through the public interfaces on the tiny random Gemma3ForConditionalGeneration of
``test_gemma3_vision``: ``llm.generate`` with vLLM's multi_modal_data, ``llm.chat`` image parts
(PIL images and data: / file:// URLs), ``limit_mm_per_prompt`` and ``allowed_local_media_path``,
the server's chat completions through the official openai client, and a batch job. Each answer
equals the same prompt run through ``llm.generate`` with its token ids (which
``test_images_engine`` holds against transformers); each bad input fails its own request only."""

import base64
import io
import json

import pytest

from tests import family_testing as ft
from tests.conftest import require
from tests.test_gemma3_vision import IMG, MARKERS, SIGLIP, TEXT, _images

pytestmark = pytest.mark.reference

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t7{% endif %}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint, its markers special tokens of its tokenizer (t93 <start_of_image>, t95 the
    image's soft token, t94 <end_of_image>) and a chat template."""
    transformers = require("transformers")
    from tokenizers import AddedToken, Tokenizer

    path = ft.write_tiny(tmp_path_factory.mktemp("g3api") / "ckpt", "gemma3", TEXT,
                         outer={"vision_config": SIGLIP, "mm_tokens_per_image": 4} | MARKERS)
    transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}).save_pretrained(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(f"t{i}", special=True, normalized=False) for i in (93, 94, 95)])
    tok.save(str(path / "tokenizer.json"))
    conf = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(conf | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def llm(ckpt, tmp_path_factory):
    from jaxinfer import LLM

    media = tmp_path_factory.mktemp("media")
    _images(1, seed=3)[0].save(media / "cat.png")
    return LLM(str(ckpt), dtype="float32", max_model_len=96, progress=False, max_num_seqs=4, block_size=4,
               max_num_batched_tokens=16, num_gpu_blocks_override=128, limit_mm_per_prompt={"image": 2},
               allowed_local_media_path=str(media))


def _sp(**kw):
    from jaxinfer import SamplingParams

    return SamplingParams(**({"temperature": 0.0, "max_tokens": 5, "ignore_eos": True} | kw))


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


def _by_ids(llm, ids, images):
    return list(llm.generate({"prompt_token_ids": list(ids), "multi_modal_data": {"image": images}}, _sp(),
                             use_tqdm=False)[0].outputs[0].token_ids)


def test_generate_with_prompt_text_and_multi_modal_data(llm):
    """Prompt text with the image marker grows it into the image's tokens as Gemma 3's processor
    writes them; one image or a list."""
    a, b = _images(2, seed=1)
    out = llm.generate({"prompt": "t9 t93 t10 t11", "multi_modal_data": {"image": a}}, _sp(), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids.count(IMG) == 4 and ids[ids.index(93):ids.index(93) + 6] == [93] + [IMG] * 4 + [94]
    assert list(out.outputs[0].token_ids) == _by_ids(llm, ids, [a])
    two = llm.generate({"prompt": "t93 t12 t93", "multi_modal_data": {"image": [a, b]}}, _sp(), use_tqdm=False)[0]
    assert two.prompt_token_ids.count(IMG) == 8
    assert list(two.outputs[0].token_ids) == _by_ids(llm, two.prompt_token_ids, [a, b])


def test_chat_image_parts_from_pil_data_and_file_urls(llm):
    img = _images(1, seed=3)[0]
    base = llm.engine.images.stats["images_encoded"]
    outs = []
    for part in ({"type": "image_pil", "image_pil": img},
                 {"type": "image_url", "image_url": {"url": _data_url(img)}},
                 {"type": "image_url", "image_url": {"url": f"file://{llm.media.allowed_local_media_path}/cat.png"}}):
        conv = [{"role": "user", "content": [part, {"type": "text", "text": " t20 t21 "}]}]
        text, ids = llm.encode_chat(conv)
        assert text.count("t95") == 4 and "t93t95" in text.replace(" ", "")
        outs.append(llm.chat(conv, _sp(), use_tqdm=False)[0])
        assert list(outs[-1].outputs[0].token_ids) == _by_ids(llm, ids, [img])
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    # encoded by the first request only: every later one (the same pixels) found its pages cached
    assert llm.engine.images.stats["images_encoded"] == base + 1


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "t93 t93 t93", "multi_modal_data": {"image": _images(3)}},
     "prompt 0: at most 2 image\\(s\\) may be provided in one prompt"),
    ({"prompt": "t9 t10", "multi_modal_data": {"image": _images(1)}}, "1 image\\(s\\) need 1 't93' in the prompt"),
    ({"prompt": "t93", "multi_modal_data": {"image": [b"not an image"]}}, "prompt 0: image 0: the data is not an image"),
    ({"prompt_token_ids": [1, 93, IMG, IMG, 94, 5], "multi_modal_data": {"image": _images(1)}},
     "need 1 run\\(s\\) of 4 image tokens \\(id 95\\) in the prompt, found runs of \\[2\\]"),
    ({"prompt": "t93", "multi_modal_data": {"audio": b"x"}}, "multi_modal_data takes 'image' only"),
])
def test_bad_image_prompts_get_one_line(llm, prompt, match):
    from jaxinfer.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=match) as e:
        llm.generate(prompt, _sp(), use_tqdm=False)
    assert "\n" not in str(e.value)


def test_local_files_only_under_allowed_local_media_path(llm, tmp_path):
    from jaxinfer.errors import InvalidRequest

    _images(1)[0].save(tmp_path / "x.png")
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/x.png"}}]}]
    with pytest.raises(InvalidRequest, match="conversation 0: .*allowed_local_media_path"):
        llm.chat(conv, _sp(), use_tqdm=False)


def test_limit_mm_per_prompt_is_checked():
    from jaxinfer.errors import InvalidRequest
    from jaxinfer.llm import _check_mm_limit

    assert _check_mm_limit({"image": 0}) == {"image": 0}
    for bad in ({"video": 1}, {"image": -1}, {"image": "2"}, [1]):
        with pytest.raises(InvalidRequest, match="limit_mm_per_prompt"):
            _check_mm_limit(bad)


def test_server_chat_with_image_parts_through_the_openai_client(llm):
    """The official client against the server on 127.0.0.1: an image part answers as llm.chat
    does; too many images, a corrupt one, or a file outside the allowed directory is a 400 for
    that request alone, and the next request is served."""
    openai = require("openai")
    from jaxinfer.server import ServerConfig
    from tests.server_testing import live_server

    img = _images(1, seed=3)[0]
    content = [{"type": "text", "text": "t20"}, {"type": "image_url", "image_url": {"url": _data_url(img)}}]
    want = llm.chat([{"role": "user", "content": content}], _sp(), use_tqdm=False)[0].outputs[0].text
    with live_server(llm, ServerConfig(model_name="g3")) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def ask(parts):
            return client.chat.completions.create(model="g3", messages=[{"role": "user", "content": parts}],
                                                  max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})

        assert ask(content).choices[0].message.content == want
        bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"xx").decode()}}
        for parts, words in ((content + content[1:] * 2, "at most 2 image"), ([bad], "not an image"),
                             ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                              "allowed_local_media_path")):
            with pytest.raises(openai.BadRequestError, match=words):
                ask(parts)
        assert ask(content).choices[0].message.content == want


def test_batch_job_with_image_parts(llm, tmp_path):
    """An OpenAI batch file with image parts: each good line answers as llm.chat does, a line
    with a corrupt image gets its own 400 and the job goes on."""
    from jaxinfer.batch import run_batch
    from tests.batch_testing import by_id, chat, check_400, check_ok, read_jsonl, write_jsonl

    imgs = _images(2, seed=7)
    parts = [[{"type": "image_url", "image_url": {"url": _data_url(i)}}, {"type": "text", "text": "t30"}] for i in imgs]
    lines = [chat(f"img{k}", p, max_tokens=5, temperature=0.0, ignore_eos=True) for k, p in enumerate(parts)]
    lines.append(chat("bad", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], max_tokens=5))
    lines.append(chat("text", "t40 t41", max_tokens=5, temperature=0.0, ignore_eos=True))
    out = tmp_path / "out.jsonl"
    run_batch(llm, write_jsonl(tmp_path / "in.jsonl", lines), out, model_name="g3", progress=False)
    got = by_id(read_jsonl(out))
    for k, p in enumerate(parts):
        want = llm.chat([{"role": "user", "content": p}], _sp(), use_tqdm=False)[0].outputs[0].text
        assert check_ok(got[f"img{k}"], "chat", 1)["choices"][0]["message"]["content"] == want
    check_400(got["bad"], "bad", "invalid_value", "messages", 3)
    check_ok(got["text"], "chat", 1)
