"""Named model configurations.

All presets use the byte-level vocabulary (256) of weft's data pipeline; a preset fixes the
shape, and callers change fields on the copy `get_preset` returns.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from weft.cliargs import GATE_CHOICES, arg, capacity_or_preset, positive_int
from weft.models.gpt import GPTConfig
from weft.moe.gates import SAMPLING_GATES

# Lancet sec. 7 ("Benchmark Models and Datasets"): GPT-2 with every other block's FFN replaced
# by an MoE layer; GPT2-S-MoE 12 layers x 768, GPT2-L-MoE 24 layers x 1024; experts scale with
# the GPUs at two per GPU (Fig. 6: 32 experts on 16 A100s); Switch gate (top-1) in Fig. 11,
# batch-prioritized in Fig. 12. The paper gives no capacity factor: 1.25 is the Switch/Tutel
# default. It trains at sequence length 512; block_size keeps GPT-2's 1024.
#
# Routing: top-1 by argmax collapses in the first steps of these byte-level models (one expert per
# layer takes most tokens: 94% of gpt2-s-moe's slots dropped at step 26 on a GPU, 13-17% still
# dropped over steps 201-600). Training samples the expert from the router's softmax instead
# (temperature 1, Switch Transformer's "sample softmax") from a router initialised 10x smaller
# (nearly uniform at the start): 2.6-3.2% (gpt2-s-moe) and 4.6% (gpt2-l-moe) dropped after step
# 200, and a validation loss still well below the dense twins' (docs/benchmarks.md, "Sampled
# routing"). Evaluation and generation route by argmax.
_LANCET_MOE = dict(moe_every=2, num_experts=32, top_k=1, gate="topk", capacity_factor=1.25, activation="gelu",
                   routing_temperature=1.0, router_init_scale=0.1)

# The layer shapes of `weft bench layer` (Mixtral-, Qwen2-MoE- and Phi-3.5-MoE-like) as 2-block
# models, every block MoE with swiglu experts; one 4096-token sequence per GPU. Attention is plain multi-head (the real
# models use grouped-query attention, and Qwen2-MoE adds shared experts): these are benchmark
# shapes, not reproductions. The real models are dropless; capacity 1.25 is the padded mode that
# every overlap engine supports.
_BENCH = dict(n_layer=2, block_size=4096, moe_every=1, activation="swiglu", capacity_factor=1.25)

PRESETS: dict[str, GPTConfig] = {
    # Trains on 2 CPU cores in minutes.
    "tiny": GPTConfig(
        block_size=128, n_layer=4, n_head=4, dim=128, moe_every=2, num_experts=8, top_k=2, moe_hidden_dim=256,
    ),
    "gpt2-s-moe": GPTConfig(block_size=1024, n_layer=12, n_head=12, dim=768, moe_hidden_dim=3072, **_LANCET_MOE),
    "gpt2-l-moe": GPTConfig(block_size=1024, n_layer=24, n_head=16, dim=1024, moe_hidden_dim=4096, **_LANCET_MOE),
    "mixtral-8x7b-2l": GPTConfig(
        dim=4096, n_head=32, num_experts=8, top_k=2, moe_hidden_dim=14336, rope_theta=1e6, **_BENCH,
    ),
    "qwen2-moe-2l": GPTConfig(
        dim=2048, n_head=16, num_experts=64, top_k=4, moe_hidden_dim=1408, rope_theta=1e6, **_BENCH,
    ),
    "phi35-moe-2l": GPTConfig(
        dim=4096, n_head=32, num_experts=16, top_k=2, moe_hidden_dim=6400, **_BENCH,
    ),
}


def dense_twin(moe: GPTConfig) -> GPTConfig:
    """The dense model with the MoE model's width, depth and active FLOPs per token: every MoE
    block becomes a dense MLP of width top_k * expert width (a token's compute in the MoE block,
    router aside). Raises ValueError when that MLP would differ from the model's dense blocks
    (another width, or an expert activation other than the dense MLP's gelu)."""
    if not moe.moe_every:
        raise ValueError("the model is dense already")
    width = moe.top_k * moe.expert_hidden
    if moe.activation != "gelu" or width != moe.dense_hidden:
        raise ValueError(f"no FLOP-equal dense twin: the MoE blocks compute {moe.top_k} x {moe.expert_hidden} "
                         f"{moe.activation}, the dense MLP {moe.dense_hidden} gelu")
    return dataclasses.replace(moe, moe_every=0)


# Dense twins of the training presets (the MoE promise is a lower loss than these at equal steps,
# data and active compute). The -2l layer-shape presets have none: every block is MoE with swiglu
# experts, and the dense MLP is gelu.
PRESETS.update({"tiny-dense": dense_twin(PRESETS["tiny"]), "gpt2-s": dense_twin(PRESETS["gpt2-s-moe"]),
                "gpt2-l": dense_twin(PRESETS["gpt2-l-moe"])})
TWINS = {"tiny": "tiny-dense", "gpt2-s-moe": "gpt2-s", "gpt2-l-moe": "gpt2-l"}

# Domino's dense GPT-3 2.7B (Brown et al. table 2.1: 32 layers x 2560, 32 heads, sequence 1024
# here; bytes instead of BPE tokens), the model of tensor parallelism's tables (`--tp`).
PRESETS["gpt3-2.7b"] = GPTConfig(block_size=1024, n_layer=32, n_head=32, dim=2560, moe_every=0)


def get_preset(name: str) -> GPTConfig:
    """A copy of the named preset (safe to modify)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


@dataclass
class PresetChoice:
    """A preset with a batch size and optional gate / capacity overrides (the model part of the
    configs of `weft plan` and `weft bench model`)."""

    preset: str = arg("gpt2-s-moe", "model preset (see weft.models.PRESETS)")
    batch_size: int = arg(8, "sequences per rank", parse=positive_int)
    gate: str | None = arg(None, "override the preset's gate", choices=GATE_CHOICES)
    capacity: float | str | None = arg("preset", "override the preset's capacity factor ('dropless' for None)",
                                       parse=capacity_or_preset)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown --preset {self.preset!r}; choose from {', '.join(PRESETS)}")

    def model_config(self) -> GPTConfig:
        """The preset with the overrides applied (checked)."""
        overrides = {}
        if self.gate is not None:
            overrides["gate"] = self.gate
            if self.gate not in SAMPLING_GATES:  # expert-choice and random gates do not sample by probability
                overrides["routing_temperature"] = 0.0
        if self.capacity != "preset":
            overrides["capacity_factor"] = self.capacity
        base = get_preset(self.preset)
        return GPTConfig.from_dict({**base.to_dict(), **overrides})
