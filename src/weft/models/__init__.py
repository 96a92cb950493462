"""GPT-style models with MoE blocks, and named presets."""
from weft.models.gpt import GPT, GPTConfig
from weft.models.presets import PRESETS, get_preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "get_preset"]
