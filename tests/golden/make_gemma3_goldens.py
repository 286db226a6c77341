"""Make golden outputs for Gemma 3 270M (GGUF Q4_K_M) from an independent reference.

The reference is Hugging Face transformers on PyTorch CPU in float32: transformers reads the
GGUF itself (its own dequantizer; it subtracts the 1 that llama.cpp's converter added to every
Gemma norm weight) and runs Gemma3ForCausalLM (``gemma3_text``) with eager attention, so nothing
from jaxinfer is used except ``registry`` to locate the file.

Regenerate (from the repository root, with the ``reference`` extra installed; ~10 minutes on
two CPU threads, most of it loading the GGUF and the long prompt)::

    python tests/golden/make_gemma3_goldens.py

The record per prompt is the one ``make_goldens.py`` writes for SmolLM2 (its helpers are reused):
``prompt_ids`` (``tokenizer(text)``: this tokenizer prepends ``<bos>``), 32 ``greedy_ids`` from a
KV-cached loop with EOS ignored, ``margins`` (top1 - top2 logit), ``logits`` summaries at the
generated steps ``LOGIT_STEPS`` from one uncached forward pass, and prompt logprobs for two
prompts. The GGUF is a base model without a chat template, so prompts are plain text; one of
them writes Gemma's turn markers as text, and one is longer than the 512-token sliding window so
that generation runs with local layers that no longer see the start of the prompt.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as base

MODEL = "gemma-3-270m"
DEFAULT_OUT = Path(__file__).resolve().parent / "gemma-3-270m.json"
PROMPT_LOGPROBS_FOR = ("prose", "turn_markers")

PARAGRAPHS = [
    base.LONG_PARAGRAPH + ".",
    ("Rivers shape the land they cross. Over thousands of years a river cuts valleys, carries "
    "sand and gravel downstream and builds deltas where it meets the sea. Floods spread fertile "
    "silt across the plains, which is why so many early farming villages grew up along the Nile, "
    "the Tigris, the Euphrates, the Indus and the Yellow River. Engineers later learned to tame "
    "rivers with levees, canals and dams, trading the risk of floods for electricity, irrigation "
    "and reliable shipping, but often at the cost of wetlands, fish and the sediment that deltas "
    "need to keep pace with the rising sea."),
    ("To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven "
    "grams of dried yeast and three hundred and fifty millilitres of warm water. Knead the dough "
    "for about ten minutes until it is smooth and elastic, then leave it covered in a warm place "
    "until it has doubled in size. Knock it back, shape it into a loaf, let it rise again for half "
    "an hour and bake it at two hundred and twenty degrees for thirty to thirty-five minutes, "
    "until the crust is golden and the base sounds hollow when tapped."),
    ("The night sky has guided travellers for millennia. Polynesian navigators crossed thousands of "
    "kilometres of open ocean by memorising the rising and setting points of stars, reading the "
    "swell and watching the flight of birds. In the northern hemisphere the Pole Star stays almost "
    "fixed above the horizon, so its height gives a sailor's latitude. Finding longitude was much "
    "harder: it took accurate clocks, first built by John Harrison in the eighteenth century, to "
    "compare local noon with the time at a home port."),
]
PAST_WINDOW = "\n\n".join(PARAGRAPHS + PARAGRAPHS[1:3]) + "\n\nAll of these stories show that"

PLAIN = [
    ("france", "The capital of France is"),
    ("prose", "Once upon a time, in a small village at the edge of a great forest,"),
    ("code", "def fibonacci(n):\n"),
    ("numbers", "The first ten prime numbers are 2, 3, 5, 7,"),
    ("unicode", ("Café crème ☕ and croissants 🥐 make a classic French breakfast. "
                "In Japanese, breakfast is called 朝食 (chōshoku), and")),
    ("whitespace", "  Two leading spaces,\ttabs,\n\n- a list item\n-   another    with gaps\n"),
    ("turn_markers", ("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                     "<start_of_turn>model\n")),
    ("long_paragraph", base.LONG_PARAGRAPH),
    ("past_window", PAST_WINDOW),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxinfer import registry

    path = Path(registry.fetch(MODEL))
    entry = registry.REGISTRY[MODEL]
    actual_sha = base.sha256(path)
    if actual_sha != entry.sha256:
        sys.exit(f"sha256 mismatch for {path}: {actual_sha} != {entry.sha256}")

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    c = model.config
    assert c.model_type == "gemma3_text" and c._attn_implementation == "eager"
    print(f"loaded in {time.time() - t0:.1f}s: {c.layer_types.count('full_attention')} global "
          f"layers, window {c.sliding_window}, rope {c.rope_parameters}", file=sys.stderr)

    base.PROMPT_LOGPROBS_FOR = PROMPT_LOGPROBS_FOR
    prompts, plps, checks = [], [], {}
    for n, text in PLAIN:
        rec, plp, check = base.run_prompt(model, tok, n, "plain", text, {"prompt": text})
        prompts.append(rec)
        checks[n] = check
        if plp is not None:
            plps.append(plp)
        print(f"[{n}] T={len(rec['prompt_ids'])} min_margin={min(rec['margins']):.4f} "
              f"{rec['greedy_text']!r} ({time.time() - t0:.0f}s)", file=sys.stderr)
    long = next(p for p in prompts if p["name"] == "past_window")
    assert len(long["prompt_ids"]) > c.sliding_window, len(long["prompt_ids"])

    doc = {
        "metadata": {
            "model": MODEL,
            "gguf_file": path.name,
            "gguf_sha256": entry.sha256,
            "reference": "transformers AutoModelForCausalLM (GGUF dequantized by transformers)",
            "hf_model_type": c.model_type,
            "attn_implementation": "eager",
            "hf_config": {
                "layer_types": c.layer_types, "sliding_window": c.sliding_window,
                "rope_parameters": c.rope_parameters, "query_pre_attn_scalar": c.query_pre_attn_scalar,
                "final_logit_softcapping": c.final_logit_softcapping, "rms_norm_eps": c.rms_norm_eps,
                "head_dim": c.head_dim, "tie_word_embeddings": c.tie_word_embeddings,
            },
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "device": "cpu",
            "torch_threads": args.threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python tests/golden/make_gemma3_goldens.py",
            "tokenizer_adds_bos": tok("x", add_special_tokens=True)["input_ids"]
            != tok("x", add_special_tokens=False)["input_ids"],
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "vocab_size": c.vocab_size,
            "n_new_tokens": base.N_NEW,
            "eos_ignored": True,
            "top_k": base.TOP_K,
            "logit_steps": list(base.LOGIT_STEPS),
            "self_check": checks,
            "notes": [
                "prompt_ids = tokenizer(prompt_text, add_special_tokens=True).input_ids (<bos> first)",
                "greedy: argmax at every step, EOS ignored, always n_new_tokens tokens",
                "margins[k] = top1 - top2 logit of the distribution that chose greedy_ids[k]",
                ("logits[].position is the absolute position whose output logits are stored; "
                "they predicted greedy_ids[step] (position = len(prompt_ids) - 1 + step)"),
                ("top_logits are float32 values; logsumexp/mean/std are float64 statistics of "
                "the float32 logits over the full vocabulary (std with ddof=0)"),
                ("greedy_ids from a KV-cached loop; logits/margins from one uncached forward "
                "over prompt_ids + greedy_ids[:-1] (self_check: max abs difference)"),
                "prompt_logprobs[].logprobs[i] = log_softmax(logits at position i)[ids[i+1]]",
                ("past_window is longer than the sliding window: its local layers no longer see "
                "the first prompt tokens"),
            ],
        },
        "prompts": prompts,
        "prompt_logprobs": plps,
    }
    args.out.write_text(base.dump(doc) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
