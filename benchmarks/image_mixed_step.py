"""Whether text rows pay for the images of the other rows in their batch, on this host.

The model of ``image_ttft.py`` (gemma-3-270m's text decoder, a SigLIP of the published width
with --vision-layers layers at --image-size pixels, 256 soft tokens per image), float32, one
engine step per call (num_scheduler_steps=1), interleaved repeats so the host's load drifts
alike over every case:

* decode: --text-rows text rows decoding beside --other-rows rows decoding too, whose prompts
  were text (``beside_text``) or held one image each (``beside_images``), prompts of the same
  length. The seconds of each engine step once every row decodes, median over --steps steps
  and the repeats. Rows with images in their past run the text-only executable: these should
  be equal within noise.
* prefill: the same text rows decoding while one more request's prompt is prefilled beside
  them: a prompt with an image (its encoder call included) or a text prompt of the same length.
  The seconds from adding it to its first token (the steps that prefill it), median over
  --repeat, and the encoder's call alone: with images the step costs the encoder call more.

    cd benchmarks && python image_mixed_step.py --vision-layers 2 --repeat 3 --steps 15

prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from image_ttft import BOI, EOI, IMG, write_checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision-layers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--text-rows", type=int, default=8)
    ap.add_argument("--other-rows", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from PIL import Image

    from jaxinfer import LLM, SamplingParams

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint(Path(d), a.vision_layers, a.image_size)
        llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_seqs=16, progress=False,
                  max_num_batched_tokens=512, enable_prefix_caching=False, num_scheduler_steps=1)
        eng = llm.engine
        counter = iter(range(1 << 30))

        def text(n):
            return [1] + [int(t) for t in rng.integers(10, 3000, n - 1)]

        def image():
            return Image.fromarray(rng.integers(0, 256, (a.image_size, a.image_size, 3), dtype=np.uint8))

        def with_image(n):  # n prompt tokens in all, one image's 258 of them
            ids = text(n - 258)
            return {"prompt_token_ids": ids[:3] + [BOI] + [IMG] * 256 + [EOI] + ids[3:],
                    "multi_modal_data": {"image": image()}}

        def add(prompt, max_tokens):
            t, toks = llm.encode_prompt(prompt)
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            req = llm.new_request(str(next(counter)), t, toks, sp, time.perf_counter())
            for row in req.rows:
                eng.add(row)
            return req

        def all_decoding():
            return not eng.num_waiting() and all(s is None or s.state.value == "decode" for s in eng.sched.slots)

        def drain():
            while eng.has_unfinished():
                eng.step()

        other_len = a.prompt_tokens + 258

        def decode_case(images: bool) -> list[float]:
            """Seconds of each step of the text rows and the other rows, all decoding."""
            n = a.steps + 20
            for _ in range(a.text_rows):
                add({"prompt_token_ids": text(a.prompt_tokens)}, n)
            for _ in range(a.other_rows):
                add(with_image(other_len) if images else {"prompt_token_ids": text(other_len)}, n)
            while not all_decoding():
                eng.step()
            for _ in range(3):
                eng.step()
            out = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                eng.step()
                out.append(time.perf_counter() - t0)
            drain()
            return out

        def prefill_case(images: bool) -> float:
            """Seconds from adding one prompt beside the decoding text rows to its first token."""
            for _ in range(a.text_rows):
                add({"prompt_token_ids": text(a.prompt_tokens)}, 24)
            while not all_decoding():
                eng.step()
            for _ in range(3):
                eng.step()
            t0 = time.perf_counter()
            req = add(with_image(other_len) if images else {"prompt_token_ids": text(other_len)}, 1)
            mine = {id(r) for r in req.rows}
            while not any(id(r) in mine for r in eng.step()):
                pass
            took = time.perf_counter() - t0
            drain()
            return took

        for images in (False, True):  # compile every shape these cases meet, untimed
            decode_case(images)
            prefill_case(images)
        decode = {False: [], True: []}
        prefill = {False: [], True: []}
        for _ in range(a.repeat):
            for images in (False, True):
                decode[images] += decode_case(images)
                prefill[images].append(prefill_case(images))
        enc = eng.images
        times = []
        for _ in range(a.repeat):
            px = np.stack([enc.processor(image())])
            t0 = time.perf_counter()
            enc._encode(enc.weights, px).block_until_ready()
            times.append(time.perf_counter() - t0)

        def stats(xs):
            q = np.percentile(xs, [25, 50, 75])
            return {"median_s": round(float(q[1]), 4), "iqr_s": [round(float(q[0]), 4), round(float(q[2]), 4)]}

        print(json.dumps({
            "vision_layers": a.vision_layers, "image_size": a.image_size, "text_rows": a.text_rows,
            "other_rows": a.other_rows, "prompt_tokens": a.prompt_tokens, "other_prompt_tokens": other_len,
            "steps": a.steps, "repeat": a.repeat,
            "decode_step_beside_text": stats(decode[False]), "decode_step_beside_images": stats(decode[True]),
            "decode_ratio": round(statistics.median(decode[True]) / statistics.median(decode[False]), 3),
            "prefill_beside_text_s": round(statistics.median(prefill[False]), 4),
            "prefill_beside_image_s": round(statistics.median(prefill[True]), 4),
            "encoder_call_s": round(statistics.median(times), 4),
        }))


if __name__ == "__main__":
    main()
