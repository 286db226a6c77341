"""Random Llama-shaped Hugging Face checkpoints of any size, and what loading one costs the host.

``write_llama`` writes safetensors shards with ``safetensors.numpy.save_file`` (one shard in
memory at a time, no torch or transformers), an index, ``config.json`` and a small tokenizer.
``measure_load`` loads such a directory in a fresh process and reports its peak resident memory
(``VmHWM``, reset once jax and jaxinfer are imported and the devices are up) above its resident
memory at that point, beside the bytes of the loaded weights and of each device's part of them.

    python tests/random_hf.py measure DIR --dtype bfloat16 [--tp 2]

prints that report as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
_ROOT = Path(__file__).resolve().parents[1]


def llama_tensors(*, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int,
                  vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, torch shape) of every tensor of an untied Llama, in checkpoint order."""
    H = d_model // n_heads
    out = [("model.embed_tokens.weight", (vocab, d_model))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (d_model,)),
            (p + "self_attn.q_proj.weight", (n_heads * H, d_model)),
            (p + "self_attn.k_proj.weight", (n_kv_heads * H, d_model)),
            (p + "self_attn.v_proj.weight", (n_kv_heads * H, d_model)),
            (p + "self_attn.o_proj.weight", (d_model, n_heads * H)),
            (p + "post_attention_layernorm.weight", (d_model,)),
            (p + "mlp.gate_proj.weight", (d_ff, d_model)),
            (p + "mlp.up_proj.weight", (d_ff, d_model)),
            (p + "mlp.down_proj.weight", (d_model, d_ff)),
        ]
    out += [("model.norm.weight", (d_model,)), ("lm_head.weight", (vocab, d_model))]
    return out


def _random(rng: np.random.Generator, shape, dtype: np.dtype) -> np.ndarray:
    """Finite values of magnitude 2^-7 .. 2^-3, drawn as bit patterns (several times faster
    than normal samples cast down): sign, two low exponent bits and the mantissa random."""
    n = int(np.prod(shape))
    if dtype == np.float32:
        bits = rng.integers(0, 1 << 32, n, dtype=np.uint32) & np.uint32(0x81FFFFFF) | np.uint32(0x3C000000)
    else:
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16) & np.uint16(0x81FF) | np.uint16(0x3C00)
    return bits.view(dtype).reshape(shape)


# The shape write_llama defaults to: Llama 3.2 1B's widths with a 32000-token vocabulary and
# 14 layers, 1.01 billion parameters, 2.02 GB in bfloat16.
SHAPE_2GB = dict(d_model=2048, n_layers=14, n_heads=16, n_kv_heads=8, d_ff=8192, vocab=32000)


def llama_arrays(seed: int = 0, dtype: str = "bfloat16", **shape):
    """(HF name, array) of every tensor ``write_llama(seed=seed, dtype=dtype, **shape)``
    writes, in its order: the values a load must give back."""
    rng = np.random.default_rng(seed)
    for name, s in llama_tensors(**(SHAPE_2GB | shape)):
        yield name, _random(rng, s, _DTYPES[dtype])


def write_llama(path, *, dtype: str = "bfloat16", shards: int = 4, seed: int = 0, **shape) -> dict:
    """Write the checkpoint (``shape``: keyword arguments of ``llama_tensors``, defaults
    ``SHAPE_2GB``); returns its ``checkpoint_sizes``."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dt = _DTYPES[dtype]
    shape = SHAPE_2GB | shape
    d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab = (
        shape[k] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab"))
    names = llama_tensors(**shape)
    sizes = [int(np.prod(s)) * dt.itemsize for _, s in names]
    total = sum(sizes)
    # Consecutive tensors, each in the shard its middle byte falls in when the whole is cut in
    # ``shards`` equal parts.
    groups: list[list[int]] = [[] for _ in range(shards)]
    running = 0
    for i, size in enumerate(sizes):
        groups[min(shards - 1, (2 * running + size) * shards // (2 * total))].append(i)
        running += size
    groups = [g for g in groups if g]
    arrays = llama_arrays(seed, dtype, **shape)
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = dict(next(arrays) for _ in group)
        save_file(tensors, path / fname, metadata={"format": "pt"})
        del tensors
        weight_map.update({names[i][0]: fname for i in group})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d_model,
        "intermediate_size": d_ff, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "num_hidden_layers": n_layers, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
    }))
    _write_tokenizer(path)
    return checkpoint_sizes(path)


def checkpoint_sizes(path) -> dict:
    """Of a sharded safetensors directory: the tensors' bytes, the largest shard file's and
    the largest tensor's bytes, and the shard count, read from the files' headers."""
    files = sorted(Path(path).glob("*.safetensors"))
    tensors = []
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        tensors += [v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
    return {"weights_bytes": sum(tensors), "largest_shard_bytes": max(f.stat().st_size for f in files),
            "largest_tensor_bytes": max(tensors), "shards": len(files)}


def _write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer of the 256 bytes and three specials: loading needs one, these
    checkpoints are never run on text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}))


def measure_load(path, *, dtype: str, tp: int = 1, tree=None, timeout: float = 600) -> dict:
    """Load ``path`` in a fresh process (``tp`` virtual CPU devices, the weights split over
    them as ``LLM(tensor_parallel_size=tp)`` splits them) and return its report. tree: the
    source tree whose jaxinfer loads it (default this one)."""
    pythonpath = os.pathsep.join(str(p) for p in ([tree] if tree else []) + [_ROOT])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=pythonpath,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}")
    # Run as a script, not with -m: that would put the working directory, and its jaxinfer,
    # ahead of PYTHONPATH.
    out = subprocess.run([sys.executable, __file__, "measure", str(path), "--dtype", dtype, "--tp", str(tp)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"loading {path} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def _reset_peak() -> int:
    """Start a new peak from here (Linux: writing 5 to clear_refs resets VmHWM), and return
    the resident memory now. ``ru_maxrss`` cannot serve: a child process starts from its
    parent's peak (a pytest process of 1 GB made every child's peak 1 GB), and importing
    jax peaks above where it settles."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _measure(path: str, dtype: str, tp: int) -> dict:
    import jax

    import jaxinfer.models.llama  # noqa: F401 (imported before the baseline, as the tokenizer is)
    import jaxinfer.tokenizer  # noqa: F401
    from jaxinfer.loaders import checkpoint
    from jaxinfer.sharding import make_mesh, pipeline_weight_shardings, stage_bounds, tensor_parallel_plan

    devices = jax.devices()
    if len(devices) < tp:
        raise SystemExit(f"{tp=} needs {tp} devices, have {len(devices)}")
    shardings_fn = None
    if tp > 1:
        mesh = make_mesh(model=tp, devices=devices[:tp])

        def shardings_fn(specs, cfg):  # as LLM builds it for tensor_parallel_size=tp
            tensor_parallel_plan(cfg, tp)
            return pipeline_weight_shardings(specs, mesh, stage_bounds(cfg.n_layers, 1))

    baseline = _reset_peak()
    t = time.perf_counter()
    loaded = checkpoint.load(path, dtype=dtype, shardings_fn=shardings_fn)
    leaves = jax.block_until_ready(jax.tree.leaves(loaded.weights))
    seconds = time.perf_counter() - t
    per_device = {str(d): 0 for d in devices[:tp]}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            per_device[str(shard.device)] += shard.data.nbytes
    return {
        "peak_rss_above_baseline": _status("VmHWM") - baseline,
        "baseline_rss": baseline,
        "weights_bytes": sum(leaf.nbytes for leaf in leaves),
        "replicated_bytes": sum(leaf.nbytes for leaf in leaves if leaf.sharding.is_fully_replicated),
        "device_bytes": per_device,
        "dtypes": sorted({str(leaf.dtype) for leaf in leaves}),
        "seconds": seconds,
    }


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("path")
    m.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    m.add_argument("--tp", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(_measure(a.path, a.dtype, a.tp)))


if __name__ == "__main__":
    main()
