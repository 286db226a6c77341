"""What one image adds to the time to first token through the paged engine, on this host.

A random Gemma3ForConditionalGeneration written by transformers: the text decoder of
gemma-3-270m (width 640, 18 layers, a 4,096-token vocabulary instead of 262,144) and a SigLIP
tower of the published width (1152, 16 heads, MLP 4304) with --vision-layers layers at
--image-size pixels, pooled to 256 soft tokens. The same prompt of --text-tokens text tokens
runs alone, then with one image (its 256 soft tokens, markers and newlines added), each with
max_tokens=1 after a warm-up run of each shape; the encoder's own call is timed apart.

    python benchmarks/image_ttft.py --vision-layers 4 --image-size 224 --repeat 3

prints one JSON line: seconds to the first token without and with the image (best of
--repeat, a fresh image each time so nothing is cached), the encoder call alone, and images per
second through the encoder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

V = 4096
BOI, IMG, EOI = 4000, 4001, 4002


def write_checkpoint(path: Path, vision_layers: int, image_size: int) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    text = dict(vocab_size=V, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                max_position_embeddings=4096, hidden_activation="gelu_pytorch_tanh")
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=vision_layers, num_attention_heads=16,
                  image_size=image_size, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                                       image_token_index=IMG, boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    transformers.models.gemma3.image_processing_pil_gemma3.Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t1", "eos_token": "t2", "pad_token": "t0", "unk_token": "t3",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--text-tokens", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from PIL import Image

    from jaxinfer import LLM, SamplingParams

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint(Path(d), a.vision_layers, a.image_size)
        llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_seqs=4, progress=False,
                  max_num_batched_tokens=512, enable_prefix_caching=False)
        text = [1] + [int(t) for t in rng.integers(10, 3000, a.text_tokens)]
        with_image = text[:5] + [BOI] + [IMG] * 256 + [EOI] + text[5:]
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def image():
            return Image.fromarray(rng.integers(0, 256, (a.image_size, a.image_size, 3), dtype=np.uint8))

        def ttft(prompt):
            t0 = time.perf_counter()
            llm.generate(prompt, sp, use_tqdm=False)
            return time.perf_counter() - t0

        runs = {"text": lambda: ttft({"prompt_token_ids": text}),
                "text_and_image": lambda: ttft({"prompt_token_ids": with_image, "multi_modal_data": {"image": image()}})}
        best = {}
        for name, run in runs.items():
            run()  # compiles
            best[name] = min(run() for _ in range(a.repeat))
        enc = llm.engine.images
        px = np.stack([enc.processor(image())])
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            enc._encode(enc.weights, px).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"vision_layers": a.vision_layers, "image_size": a.image_size, "text_tokens": a.text_tokens,
                          "ttft_text_s": round(best["text"], 3), "ttft_text_and_image_s": round(best["text_and_image"], 3),
                          "image_adds_s": round(best["text_and_image"] - best["text"], 3),
                          "encoder_call_s": round(min(times), 3), "images_per_s": round(1 / min(times), 3)}))


if __name__ == "__main__":
    main()
