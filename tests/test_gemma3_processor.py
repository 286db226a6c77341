"""The prompt a Gemma 3 multimodal checkpoint sees, as transformers' ``Gemma3Processor`` builds it:
the real Gemma 3 vocabulary (the registry's gemma-3-270m, with ``<image_soft_token>`` added at
id 262144 as the published multimodal checkpoints have it), the published chat template, and a
preprocessor config like theirs (896 px, 256 soft tokens per image). jaxinfer's chat path
(template, then each ``<start_of_image>`` grown into the image's soft tokens) must give the
processor's ``input_ids``, and its preprocessing the processor's ``pixel_values``."""

import numpy as np
import pytest

from tests import family_testing as ft
from tests.conftest import require

pytestmark = pytest.mark.reference

# google/gemma-3-4b-it's chat template (chat_template.jinja; the same in 12b and 27b)
TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# the published markers' spelling (tokenizer_config.json's extra_special_tokens)
SPECIALS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# a tiny tower at the published image size: 64 x 64 patches of 14 px pooled 4 x 4 into 256 tokens
SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 896, "patch_size": 14}
TEXT = {"vocab_size": 262_208, "hidden_size": 32, "intermediate_size": 64, "tie_word_embeddings": True,
        "max_position_embeddings": 2048, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, gemma3_gguf):
    """A tiny Gemma3ForConditionalGeneration carrying the real tokenizer, chat template and a
    published-size preprocessor config, with transformers' processor loaded back from it, and
    jaxinfer's LLM on it."""
    transformers = require("transformers")
    require("torch")
    from jaxinfer import LLM

    tok = transformers.GemmaTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                      extra_special_tokens=SPECIALS)
    assert tok.convert_tokens_to_ids(list(SPECIALS.values())) == [255_999, 256_000, 262_144]
    images = transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": 896, "width": 896})
    path = ft.write_tiny(tmp_path_factory.mktemp("g3proc") / "ckpt", "gemma3", TEXT,
                         outer={"vision_config": SIGLIP, "mm_tokens_per_image": 256})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=TEMPLATE,
                                 image_seq_length=256).save_pretrained(path)
    images.save_pretrained(path)
    proc = transformers.AutoProcessor.from_pretrained(path)
    llm = LLM(str(path), dtype="float32", progress=False, max_model_len=2048, max_num_batched_tokens=512,
              num_gpu_blocks_override=8, block_size=16)
    return proc, llm


def _images(n, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(37, 61), (1200, 900), (896, 896), (5, 300)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


def _chats():
    """Conversations in transformers' form ({"type": "image", "image": PIL}), 0 to 2 images."""
    a, b, c = _images(3)
    return [
        [{"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": " second"}]}],
        [{"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What is this?"}]}],
        [{"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
         {"role": "user", "content": [{"type": "text", "text": "Describe  "}, {"type": "image", "image": b},
                                      {"type": "text", "text": "\nplease."}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": a},
                                      {"type": "text", "text": "with"}, {"type": "image", "image": c},
                                      {"type": "text", "text": " — which is brighter?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": b}, {"type": "text", "text": "Caption it."}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Noise."}]},
         {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": c}]}],
    ]


def _vllm_form(conv):
    """The same conversation with vLLM's image parts ({"type": "image_pil", "image_pil": PIL})."""
    return [{**m, "content": [{"type": "image_pil", "image_pil": p["image"]} if p["type"] == "image" else p
                              for p in m["content"]]} for m in conv]


@pytest.mark.parametrize("k", range(len(_chats())))
def test_chat_prompt_ids_and_pixels_equal_the_processors(ckpt, k):
    proc, llm = ckpt
    conv = _chats()[k]
    want = proc.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                    return_tensors="np")
    _, got = llm.encode_chat(_vllm_form(conv))
    assert list(got) == want["input_ids"][0].tolist()
    n = sum(p["type"] == "image" for m in conv for p in m["content"])
    assert list(got).count(262_144) == 256 * n
    if n:
        pixels = got.images.pixels
        assert pixels.dtype == np.float32 and pixels.shape == want["pixel_values"].shape == (n, 3, 896, 896)
        np.testing.assert_allclose(pixels, want["pixel_values"], rtol=0, atol=1e-5)
    else:
        assert getattr(got, "images", None) is None


def test_generate_prompt_with_image_markers_equals_the_processors(ckpt):
    """vLLM's {"prompt": text with one <start_of_image> per image, "multi_modal_data"}: the
    processor's ids of the same text and images."""
    proc, llm = ckpt
    a, b = _images(2, seed=4)
    text = "<start_of_turn>user\nLook:<start_of_image> and <start_of_image>?<end_of_turn>\n<start_of_turn>model\n"
    want = proc(text=["<bos>" + text], images=[[a, b]], return_tensors="np", add_special_tokens=False)
    _, got = llm.encode_prompt({"prompt": text, "multi_modal_data": {"image": [a, b]}})
    assert list(got) == want["input_ids"][0].tolist()
    np.testing.assert_allclose(got.images.pixels, want["pixel_values"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("template, loops", [
    (TEMPLATE, True),
    ("{% for part in message.content %}{{ part.text }}{% endfor %}", True),
    ("{%- for m in messages -%}{{ m['content'] | trim }}{%- endfor -%}", False),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", False),
])
def test_templates_that_loop_over_content_parts_are_given_the_parts(template, loops):
    from jaxinfer.tokenizer import _CONTENT_LOOP

    assert (_CONTENT_LOOP.search(template) is not None) == loops
