"""The server on the real SmolLM2 (135M, CPU): what the openai client gets equals what
``LLM.chat`` / ``LLM.generate`` return for the same request, streamed or not."""

import openai
import pytest

from jaxinfer import SamplingParams
from jaxinfer.server import ServerConfig
from tests.server_testing import live_server

MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a large river."}]


@pytest.fixture(scope="module")
def offline(smollm2_llm):
    """Answers from the Python API, before the server takes the engine over."""
    chat = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    text = smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0),
                                use_tqdm=False)[0]
    return chat, text


def test_server_equals_the_python_api(smollm2_llm, offline):
    chat, text = offline
    with live_server(smollm2_llm, ServerConfig("smollm2")) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == chat.outputs[0].text
        assert r.choices[0].finish_reason == chat.outputs[0].finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(chat.prompt_token_ids),
                                                                      len(chat.outputs[0].token_ids))
        chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.outputs[0].text
        r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
        assert r.choices[0].text == text.outputs[0].text
