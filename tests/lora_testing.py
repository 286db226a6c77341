"""PEFT adapters for the tiny checkpoints of ``family_testing``, and PEFT's outputs as the reference.

``write_adapter`` has PEFT itself wrap a checkpoint written by transformers and save a LoRA
adapter whose A and B are both random (``init_lora_weights=False``: B is not zero, so the
adapter changes every output). ``peft_reference`` runs transformers + PEFT float32 the way
``family_testing.reference`` runs the base model: prompt log-probs, then greedy tokens with each
step's top-2 margin.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import require
from tests.family_testing import MAX_TOKENS, PROMPTS, model_outputs

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, path: Path, *, r: int, alpha: float, targets=ALL_TARGETS, rslora: bool = False,
                  seed: int = 0, layers=None) -> Path:
    """A PEFT LoRA adapter of rank r over the checkpoint at ``base``, saved to ``path``."""
    torch = require("torch")
    transformers = require("transformers")
    peft = require("peft")

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                          use_rslora=rslora, layers_to_transform=layers, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # B as large as A, so the adapter's term is not lost under the base's
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    wrapped.save_pretrained(path, safe_serialization=True)
    return Path(path)


def quantized_base(llm) -> dict:
    """The quantized weights of a loaded Llama-layout ``LLM`` as the HF modules they replace:
    module name -> ("float", weight in HF's layout) for weight-only int8 / int4 (dequantized),
    ("w8a8", values f32[I, O], scale f32[O], smooth f32[I] or None) for w8a8, whose activations
    are quantized too (``peft_reference``)."""
    import numpy as np

    from jaxinfer import quant
    from jaxinfer.models.registry import model_family

    w, cfg = llm.engine.weights, llm.engine.cfg
    out = {}
    for path, (hf, _, transpose) in model_family(cfg.family).checkpoint_names.items():
        assert "[" not in hf, f"{hf}: fused checkpoint tensors are not covered here"
        for i in range(cfg.n_layers) if path[0] == "layers" else [None]:
            q = w["layers"][i].get(path[1]) if i is not None else w.get(path[0])
            if not isinstance(q, quant.QuantArray):
                continue
            name = hf.removesuffix(".weight").format(i=i)
            if q.scheme == quant.QuantScheme.W8A8 and transpose:
                smooth = None if q.smooth is None else np.asarray(q.smooth, np.float32)
                out[name] = ("w8a8", np.asarray(q.values_io(), np.float32), np.asarray(q.scale, np.float32), smooth)
            else:
                m = np.asarray(q.dequantize_matrix() if transpose else q.dequantize(), np.float32)
                out[name] = ("float", m.T if transpose else m)
    return out


def peft_reference(base: Path, adapter: Path | None, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, *,
                   int8: bool = False, quantized: dict | None = None) -> list[dict]:
    """transformers (+ PEFT's adapter, unless None) float32: per prompt its prompt log-probs and
    greedy tokens with each step's top-2 margin (``family_testing.reference``'s dicts). int8:
    every matrix of the base model (embedding and head too) first rounded as weight-only int8
    rounds it, symmetric with one scale per output channel (row), the adapter left float.
    quantized (``quantized_base``): those modules' weights replaced by the dequantized ones, and
    a w8a8 module's input (times its smoothing) rounded to int8 per token before its integer
    product, the adapter left float."""
    torch = require("torch")
    transformers = require("transformers")

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    if int8:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    amax = p.abs().amax(dim=1, keepdim=True)
                    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
                    p.copy_(torch.clamp(torch.round(p / scale), -127, 127) * scale)

    class W8A8Linear(torch.nn.Linear):
        """y = round(x * smooth / s) @ values * s * scale, s = max|x * smooth| / 127 per token."""

        def forward(self, x):
            xf = x if self.smooth is None else x * self.smooth
            amax = xf.abs().amax(dim=-1, keepdim=True)
            s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
            y = (torch.clamp(torch.round(xf / s), -127, 127) @ self.values) * s * self.wscale
            return y if self.bias is None else y + self.bias

    with torch.no_grad():
        for name, (kind, *arrays) in (quantized or {}).items():
            m = model.get_submodule(name)
            if kind == "float":
                m.weight.copy_(torch.tensor(arrays[0]))
                continue
            values, scale, smooth = arrays
            m.__class__ = W8A8Linear  # still a torch Linear: PEFT wraps it as one
            m.values, m.wscale = torch.tensor(values), torch.tensor(scale)
            m.smooth = None if smooth is None else torch.tensor(smooth)
    if adapter is not None:
        peft = require("peft")
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return model_outputs(model, prompts, max_tokens)
