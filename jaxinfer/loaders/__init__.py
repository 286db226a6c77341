"""Checkpoint loaders: GGUF, Hugging Face safetensors directories and Orbax."""
