"""jaxinfer: a JAX/XLA inference engine for open large language models.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    print(llm.generate("The capital of France is")[0].outputs[0].text)
"""

from jaxinfer.errors import JaxinferError

__all__ = ["LLM", "SamplingParams", "LoRARequest", "JaxinferError"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy, so `import jaxinfer` (and the CLI's --help) stays cheap
    if name == "LLM":
        from jaxinfer.llm import LLM

        return LLM
    if name == "LoRARequest":
        from jaxinfer.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from jaxinfer.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
