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


def peft_reference(base: Path, adapter: Path | None, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, *,
                   int8: bool = False) -> list[dict]:
    """transformers (+ PEFT's adapter, unless None) float32: per prompt its prompt log-probs and
    greedy tokens with each step's top-2 margin (``family_testing.reference``'s dicts). int8:
    every matrix of the base model (embedding and head too) first rounded as weight-only int8
    rounds it, symmetric with one scale per output channel (row), the adapter left float."""
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
    if adapter is not None:
        peft = require("peft")
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    return model_outputs(model, prompts, max_tokens)
