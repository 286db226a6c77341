"""Hugging Face Hub ids: the real huggingface_hub download path against a local Hub.

``tests/hub_server.py`` serves tiny checkpoints written by transformers over HTTP on 127.0.0.1
(LFS files through a second "CDN" server, as huggingface.co does); huggingface_hub finds it
through ``HF_ENDPOINT`` and caches into a temporary ``HF_HUB_CACHE``. The server records every
request, so the tests see exactly which files were fetched.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxinfer import hub, registry
from jaxinfer.errors import CheckpointError, InvalidRequest, UnknownModel
from tests.hub_server import LocalHub

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 6, 7, 8, 9]
ENGINE = dict(progress=False, max_num_seqs=8, kv_cache_memory_bytes=16 << 20, max_model_len=128)
TOKEN = "hf_test_token"

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
# what the loaders read of the sharded repository, and nothing else
WANTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "model.safetensors.index.json", *SHARDS}
# beside them on the Hub, never to be fetched
NOT_WANTED = {"pytorch_model.bin": b"\x80\x02pickle" * 64, "extra.gguf": b"GGUF" + bytes(256),
              "consolidated.safetensors": bytes(512), "README.md": b"# tiny\n![diagram](assets/diagram.png)\n",
              "assets/diagram.png": b"\x89PNG" + bytes(64), "onnx/model.onnx": bytes(128),
              "flax_model.msgpack": bytes(128), "tf_model.h5": bytes(128), ".gitattributes": b"*.bin filter=lfs\n"}


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _shard(src: Path, dest: Path) -> Path:
    """``src`` with its model.safetensors split in two shards and an index, as big checkpoints are."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dest)
    (dest / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for shard, part in zip(SHARDS, halves):
        save_file({n: tensors[n] for n in part}, dest / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    total = sum(t.nbytes for t in tensors.values())
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    return dest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny Llama checkpoints written by transformers: main (sharded), v2 (another seed and 2
    layers), one of an architecture jaxinfer does not implement."""
    from tests.family_testing import write_tiny

    root = tmp_path_factory.mktemp("hub-checkpoints")
    tiny = write_tiny(root / "tiny", "llama", {})
    v2 = write_tiny(root / "v2", "llama", {"num_hidden_layers": 2}, seed=1)
    foo = shutil.copytree(tiny, root / "foo")
    config = json.loads((foo / "config.json").read_text())
    (foo / "config.json").write_text(json.dumps(config | {"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    return SimpleNamespace(tiny=tiny, sharded=_shard(tiny, root / "sharded"), v2=v2, foo=foo)


@pytest.fixture(scope="module")
def local_hub(ckpt, tiny_gguf):
    h = LocalHub()
    h.add("org/tiny", _files(ckpt.sharded) | NOT_WANTED)
    h.add("org/tiny", _files(ckpt.v2), revision="v2")
    h.add("org/gated", _files(ckpt.tiny), token=TOKEN)
    h.add("org/bin-only", {k: v for k, v in _files(ckpt.tiny).items() if k != "model.safetensors"}
          | {"pytorch_model.bin": NOT_WANTED["pytorch_model.bin"]})
    h.add("org/foo", _files(ckpt.foo))
    h.add("org/cut", _files(ckpt.tiny))
    h.add("org/tiny-gguf", {"tiny.gguf": tiny_gguf.read_bytes(), "other.gguf": b"GGUF" + bytes(1024),
                            "README.md": b"# tiny gguf\n"})
    yield h
    h.close()


def _hub_env(h: LocalHub, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    return env | {"HF_ENDPOINT": h.url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home")}


@pytest.fixture
def hub_env(local_hub, tmp_path, monkeypatch):
    """This process pointed at the local Hub with an empty cache. huggingface_hub reads its
    environment once, when first imported (transformers may have imported it already in this
    process); reloading its constants module makes it read the variables set here, as a fresh
    process would. The CLI tests run fresh processes and need no such step."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"

    def use(**extra):
        for k, v in (_hub_env(local_hub, cache) | extra).items():
            monkeypatch.setenv(k, v)
        for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            if k not in extra:
                monkeypatch.delenv(k, raising=False)
        importlib.reload(constants)

    use()
    local_hub.clear()
    yield SimpleNamespace(hub=local_hub, cache=cache, use=use)
    monkeypatch.undo()
    importlib.reload(constants)


@pytest.fixture(scope="module")
def local_llm(ckpt):
    """The tiny checkpoint loaded from its directory: the reference for what the Hub gives."""
    from jaxinfer import LLM

    return LLM(str(ckpt.tiny), **ENGINE)


def _greedy(llm, prompt=PROMPT, n=12) -> list[int]:
    from jaxinfer import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0].token_ids


# ------------------------------------------------------------------ ids
@pytest.mark.parametrize("name, parsed", [
    ("org/name", ("org/name", None)),
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None)),
    ("org/name-GGUF:name.Q4_K_M.gguf", ("org/name-GGUF", "name.Q4_K_M.gguf")),
    ("smollm2-135m-instruct", None),  # a registry name
    ("/abs/path", None), ("./rel/dir", None), ("a/b/c", None),
    ("models/tiny.gguf", None),  # reads as a local file, not a repository
    ("org/name:", None),
])
def test_what_reads_as_a_hub_id(name, parsed):
    assert hub.parse_hub_id(name) == parsed


def test_registry_names_and_paths_keep_working(smollm2_gguf, tmp_path):
    assert registry.resolve("smollm2-135m-instruct", progress=False) == smollm2_gguf
    assert registry.resolve(tmp_path) == tmp_path
    with pytest.raises(InvalidRequest, match="revision applies to a Hugging Face Hub id"):
        registry.resolve("smollm2-135m-instruct", revision="main")
    with pytest.raises(UnknownModel, match="not a Hugging Face Hub id"):
        registry.resolve("no-such-model")


# ------------------------------------------------------------------ what is fetched
def test_fetches_only_what_the_loaders_read(hub_env, ckpt):
    path = hub.download("org/tiny", progress=False)
    h = hub_env.hub
    assert sorted(h.downloaded("org/tiny")) == sorted(WANTED)  # each once
    assert h.touched("org/tiny") == WANTED  # the others not even asked about
    assert path.is_relative_to(hub_env.cache)
    for name in WANTED:
        assert (path / name).read_bytes() == (ckpt.sharded / name).read_bytes()
    assert {p.name for p in path.iterdir()} == WANTED


def test_second_call_served_from_the_cache_then_offline(hub_env):
    first = hub.download("org/tiny", progress=False)
    hub_env.hub.clear()
    assert hub.download("org/tiny", progress=False) == first
    assert hub_env.hub.touched("org/tiny") == set()  # no file asked about again, let alone downloaded
    assert all(r.path.startswith("/api/") for r in hub_env.hub.requests)  # only "which commit is main"

    hub_env.use(HF_HUB_OFFLINE="1")
    hub_env.hub.clear()
    assert hub.download("org/tiny", progress=False) == first
    assert hub_env.hub.requests == []
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set"):
        hub.download("org/tiny", revision="v2", progress=False)


def test_revision(hub_env, ckpt):
    main = hub.download("org/tiny", progress=False)
    v2 = hub.download("org/tiny", revision="v2", progress=False)
    assert v2 != main
    assert json.loads((v2 / "config.json").read_text())["num_hidden_layers"] == 2
    assert (v2 / "model.safetensors").read_bytes() == (ckpt.v2 / "model.safetensors").read_bytes()
    assert json.loads((main / "config.json").read_text())["num_hidden_layers"] == 3


def test_download_dir_instead_of_the_cache(hub_env, tmp_path):
    path = hub.download("org/tiny", revision="v2", download_dir=tmp_path / "mine", progress=False)
    assert path.is_relative_to(tmp_path / "mine") and not hub_env.cache.exists()


def test_gguf_file_of_a_repository(hub_env, tiny_gguf):
    from jaxinfer.loaders import checkpoint

    path = registry.resolve("org/tiny-gguf:tiny.gguf", progress=False)
    assert path.name == "tiny.gguf" and path.read_bytes() == tiny_gguf.read_bytes()
    assert hub_env.hub.touched("org/tiny-gguf") == {"tiny.gguf"}
    assert hub_env.hub.downloaded("org/tiny-gguf") == ["tiny.gguf"]
    assert checkpoint.load(path, dtype="float32").cfg.n_layers == 2
    assert hub.download("org/tiny-gguf", gguf_file="tiny.gguf", progress=False) == path


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("name, kwargs, error, words", [
    ("org/gated", {}, CheckpointError, ["org/gated", "gated", "HF_TOKEN"]),
    ("org/missing", {}, UnknownModel, ["no Hugging Face Hub repository 'org/missing'", "HF_TOKEN"]),
    ("org/tiny", {"revision": "v3"}, UnknownModel, ["org/tiny has no revision 'v3'"]),
    ("org/bin-only", {}, CheckpointError, ["pytorch_model.bin", "only safetensors and GGUF"]),
    ("org/foo", {}, CheckpointError, ["org/foo: unsupported architecture FooForCausalLM"]),
    ("org/tiny-gguf", {}, CheckpointError, ["no config.json", "org/tiny-gguf:FILE.gguf", "other.gguf, tiny.gguf"]),
    ("org/tiny-gguf:nope.gguf", {}, CheckpointError, ["has no file nope.gguf"]),
    ("org/tiny:model.bin", {}, UnknownModel, ["only a .gguf file"]),
])
def test_errors_say_what_to_do_in_one_line(hub_env, name, kwargs, error, words):
    from jaxinfer.llm import _architecture_check

    with pytest.raises(error) as e:
        registry.resolve(name, progress=False, check_config=_architecture_check(name), **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    # no weights were downloaded for a model that cannot be loaded
    assert not any(f.endswith((".safetensors", ".bin")) for f in hub_env.hub.downloaded(name.split(":")[0]))


def test_gated_repository_with_a_token(hub_env):
    hub_env.use(HF_TOKEN="hf_not_this_one")
    with pytest.raises(CheckpointError, match="the token set now has no access"):
        hub.download("org/gated", progress=False)
    hub_env.use(HF_TOKEN=TOKEN)
    assert (hub.download("org/gated", progress=False) / "model.safetensors").is_file()


def test_a_shard_cut_short_leaves_nothing_behind_and_a_retry_succeeds(hub_env, ckpt):
    """The server sends half the file and drops the connection on every try (huggingface_hub
    tries 6 times, a second apart): one clear error, and no partial file in the cache."""
    hub_env.hub.cut_short("org/cut", "model.safetensors")
    try:
        with pytest.raises(CheckpointError, match="downloading org/cut failed: .*run again"):
            hub.download("org/cut", progress=False)
    finally:
        hub_env.hub.heal()
    size = (ckpt.tiny / "model.safetensors").stat().st_size
    kept = [p for p in hub_env.cache.rglob("*") if p.is_file() and p.stat().st_size >= size // 2]
    assert kept == []  # neither the half nor an .incomplete file
    hub_env.hub.clear()
    path = hub.download("org/cut", progress=False)
    assert (path / "model.safetensors").read_bytes() == (ckpt.tiny / "model.safetensors").read_bytes()
    assert hub_env.hub.downloaded("org/cut") == ["model.safetensors"]  # the small files were kept


# ------------------------------------------------------------------ LLM
def test_llm_from_a_hub_id_equals_the_local_directory(hub_env, local_llm, ckpt):
    from jaxinfer import LLM
    from jaxinfer.engine.speculative import SpeculativeConfig

    llm = LLM("org/tiny", **ENGINE)
    assert llm.model_path.is_relative_to(hub_env.cache)
    assert _greedy(llm) == _greedy(local_llm)
    # a draft model named by a Hub id, at a revision, into the target's download_dir
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": "org/tiny", "revision": "v2",
                                    "num_speculative_tokens": 2})
    cfg, _ = LLM._load_draft(spec, "float32", False, hub_env.cache.parent / "drafts")
    assert cfg.n_layers == 2
    assert (hub_env.cache.parent / "drafts" / "models--org--tiny").is_dir()


def test_generation_config_as_vllm_reads_it(ckpt, local_llm, tmp_path):
    """eos_token_id (a list) stops generation; temperature, top_p, top_k and max_new_tokens are
    the defaults of get_default_sampling_params (generation_config="auto"), ignored by "vllm"."""
    from jaxinfer import LLM, SamplingParams

    gen = shutil.copytree(ckpt.tiny, tmp_path / "gen")
    (gen / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0, "temperature": 0.6, "top_p": 0.9,
         "top_k": 20, "max_new_tokens": 5}))
    auto = LLM(str(gen), **ENGINE)
    d = auto.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.6, 0.9, 20, 5)
    assert len(auto.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) <= 5  # the defaults were used
    plain = LLM(str(gen), generation_config="vllm", **ENGINE)
    assert plain.get_default_sampling_params() == SamplingParams()
    assert {2, 7} <= auto.tokenizer.eos_ids and {2, 7} <= plain.tokenizer.eos_ids  # EOS either way, as vLLM
    # batch jobs (and the server, through the same defaults) take the file's values for fields a
    # request leaves unset; the command line's and the request's own win
    from jaxinfer.batch.formats import _OpenAIFormat

    body = {"method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "t5 t6"}}
    line = lambda b: json.dumps({"custom_id": "a", **body, "body": {**body["body"], **b}}).encode()  # noqa: E731
    for fmt, b, want in ((_OpenAIFormat(None, "m"), {}, (0.6, 0.9, 20, 5)),
                         (_OpenAIFormat({"top_k": 3}, "m"), {"temperature": 0.0}, (0.0, 0.9, 3, 5))):
        key, _, env = fmt.classify(1, line(b), indexing=True)
        p = fmt.work(auto, 1, key, env).params
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == want
    assert fmt.work(plain, 1, key, env).params.top_p == 1.0
    assert 7 not in local_llm.tokenizer.eos_ids

    # the same seeded samples without and with 7 as EOS: a row that drew 7 stops there
    sp = SamplingParams(temperature=1.0, seed=3, n=8, max_tokens=48)
    free = [o.token_ids for o in local_llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs]
    stopped = auto.generate([PROMPT], sp, use_tqdm=False)[0].outputs
    rows = [j for j, toks in enumerate(free) if 7 in toks and 2 not in toks[: toks.index(7)]]
    assert rows, "no sample drew token 7; pick another seed"
    for j in rows:
        cut = free[j][: free[j].index(7) + 1]
        assert stopped[j].token_ids == cut and stopped[j].finish_reason == "stop"


def test_generation_config_values_are_checked(ckpt, tmp_path):
    from jaxinfer.llm import generation_defaults

    gen = shutil.copytree(ckpt.tiny, tmp_path / "gen")
    (gen / "generation_config.json").write_text(json.dumps({"top_p": 0.0, "temperature": None}))
    with pytest.raises(CheckpointError, match="generation_config.json: top_p must be in"):
        generation_defaults(gen)
    assert generation_defaults(ckpt.tiny) == {}  # transformers' file without sampling values


# ------------------------------------------------------------------ CLI
def _cli(local_hub, tmp_path, *args, **env):
    env = _hub_env(local_hub, tmp_path / "hf-cache") | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)} | env
    return subprocess.run([sys.executable, "-m", "jaxinfer", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)


def test_cli_generate_and_batch_from_a_hub_id(local_hub, local_llm, tmp_path):
    from jaxinfer import SamplingParams

    p = _cli(local_hub, tmp_path, "generate", "--model", "org/tiny", "--prompt", "t5 t6 t7 t8", "--max-tokens", 6,
             "--json")
    assert p.returncode == 0, p.stderr
    want = local_llm.generate("t5 t6 t7 t8", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert json.loads(p.stdout)["token_ids"] == want.outputs[0].token_ids

    (tmp_path / "prompts.txt").write_text("t5 t6 t7 t8\nt9 t10\n")
    p = _cli(local_hub, tmp_path, "batch", "prompts.txt", "-o", "out.jsonl", "--model", "org/tiny", "--raw",
             "--max-tokens", 6, "--max-num-seqs", 8, "--no-progress", HF_HUB_OFFLINE="1")  # the cache is warm
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    want = local_llm.generate(["t5 t6 t7 t8", "t9 t10"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert [r["text"] for r in rows] == [w.outputs[0].text for w in want]


@pytest.mark.parametrize("args, words", [
    (["--model", "org/gated"], ["org/gated is a gated repository", "HF_TOKEN"]),
    (["--model", "org/missing"], ["no Hugging Face Hub repository 'org/missing'"]),
    (["--model", "org/tiny", "--revision", "v3"], ["org/tiny has no revision 'v3'"]),
    (["--model", "org/foo"], ["unsupported architecture FooForCausalLM"]),
])
def test_cli_errors_one_line_exit_2(local_hub, tmp_path, args, words):
    # --json: no progress bars, so stderr holds the error line alone
    p = _cli(local_hub, tmp_path, "generate", *args, "--prompt", "t5", "--json")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("jaxinfer: error: ") and all(w in p.stderr for w in words), p.stderr


def test_revision_and_download_dir_on_every_model_command():
    from jaxinfer.cli import build_parser

    for cmd in (["generate", "--prompt", "x"], ["chat"], ["batch", "in.txt", "-o", "out.jsonl"], ["bench"],
                ["warmup"], ["serve"]):
        a = build_parser().parse_args(cmd + ["--model", "org/name", "--revision", "v2", "--download-dir", "d"])
        assert (a.model, a.revision, a.download_dir) == ("org/name", "v2", "d")
