"""Other libraries' MoE layers, set up for `weft bench layer`, and tensor-parallel blocks, for
`weft bench tp`.

There are two MoE peers, built with the same shapes as weft's layer:

* ``torchtitan``: torchtitan's ``MoE`` (``torchtitan.models.common.moe``, tested with 0.3.0).
* ``megatron``: Megatron-Core's ``MoELayer`` with the all-to-all token dispatcher (tested with
  0.19.2).

and two tensor-parallel peers, :func:`build_tp_peer`, with weft's dense block shape, tensor
parallel over all ranks:

* ``megatron``: Megatron-Core's ``TransformerBlock`` from the local spec (no Transformer Engine;
  written against 0.19.2, not yet run on GPUs).
* ``deepspeed``: DeepSpeed's Domino (``deepspeed.runtime.domino.transformer.DominoTransformer``,
  the paper authors' code; tested with 0.19.8 on CPU gloo ranks).

Each peer is imported only inside :func:`build_peer`, so weft never needs them. Call
:func:`build_peer` on every rank after torch.distributed is initialised. Experts are split over
all ``world_size`` ranks (expert parallel), with no tensor or pipeline parallelism. Each
``PeerLayer.forward`` takes and returns ``(tokens, dim)`` tensors, and the result can be
backpropagated through.

The peers are not dependencies of weft. On a machine without network, put their wheels in
``.whl/`` (``scripts/peer_wheels.sh`` downloads and builds them: torchtitan==0.3.0,
spmd_types==0.2.3, tyro, docstring-parser, typeguard, typing_extensions, megatron-core==0.19.2,
deepspeed==0.19.8 and what it imports) and install them beside the system's torch::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH

DeepSpeed is an sdist on PyPI; the script builds it as a pure-Python wheel (`DS_BUILD_OPS=0`:
Domino needs none of its compiled ops) and fetches what its imports need (einops, hjson, msgpack,
psutil, py-cpuinfo, pydantic 2) for the GPU machine's Python.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from weft.models.gpt import apply_rotary, rotary_tables

PEERS = ("torchtitan", "megatron")
_ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
_INIT_STD = 0.02
_SEED = 1234
_EP_MESHES: dict[tuple[str, int], object] = {}  # (device type, world size) -> torchtitan's EP DeviceMesh
_TORCH_SHIMS: list[str] = []  # what was added to torch for a peer, once per process


class PeerUnavailable(RuntimeError):
    """The peer cannot run here: it is not installed, it fails to import, or it does not support
    the requested configuration. The message gives the reason."""


@dataclass
class PeerLayer:
    """One peer's MoE layer behind a common interface.

    Attributes:
        module: the peer's own ``nn.Module`` (its parameters are the layer's parameters).
        description: how the peer is configured (dispatcher, expert GEMMs, capacity handling).
        run: maps ``(T, D)`` to ``(T, D)``; :meth:`forward` calls it.
    """

    module: nn.Module
    description: str
    run: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` of shape ``(tokens, dim)``; returns ``(tokens, dim)``."""
        if x.dim() != 2:
            raise ValueError(f"expected x of shape (tokens, dim), got {tuple(x.shape)}")
        return self.run(x)

    __call__ = forward


def build_peer(
    name: str,
    dim: int,
    hidden_dim: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    activation: str,
    dtype: torch.dtype,
    device: torch.device | str,
    world_size: int,
) -> PeerLayer:
    """Build peer ``name`` with weft's layer shapes, with experts split over ``world_size`` ranks.

    ``capacity_factor`` None means dropless. A number means a fixed capacity: tokens over it are
    dropped and the expert inputs are padded up to it. Raises ``ValueError`` for an unknown peer
    or impossible shapes, and :class:`PeerUnavailable` when the peer cannot run this here.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; choose from {PEERS}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose from {_ACTIVATIONS}")
    if world_size < 1 or num_experts % world_size:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of world_size ({world_size})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
    device = torch.device(device)
    build = _build_torchtitan if name == "torchtitan" else _build_megatron
    return build(dim, hidden_dim, num_experts, top_k, capacity_factor, activation, dtype, device, world_size)


# -- helpers ---------------------------------------------------------------------------------

def _import(package: str, modules: tuple[str, ...], wheel: str) -> list:
    """Import ``modules`` of ``package``, turning every failure into PeerUnavailable."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise PeerUnavailable(f"{package} is not installed (install the wheel {wheel}; see peers.py)")
    try:
        with warnings.catch_warnings():  # both warn about missing Apex / Transformer Engine at import
            warnings.simplefilter("ignore")
            return [importlib.import_module(m) for m in modules]
    except Exception as e:  # an import can fail on any API mismatch, not only ImportError
        raise PeerUnavailable(f"importing {package} failed: {type(e).__name__}: {e}") from e


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _check_distributed(world_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError("build_peer needs torch.distributed initialised (NCCL) on every rank first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size {world_size} != torch.distributed world size {dist.get_world_size()}")


# -- torchtitan ------------------------------------------------------------------------------

def _build_torchtitan(dim, hidden_dim, num_experts, top_k, capacity_factor, activation, dtype, device,
                      world_size) -> PeerLayer:
    """torchtitan's MoE: token-choice top-k router, GroupedExperts (SwiGLU, torch._grouped_mm) and
    AllToAllTokenDispatcher. The experts are split over the ranks by hand: each rank builds only its
    ``E / W`` experts as plain tensors, which is what ``to_local()`` of torchtitan's Shard(0)
    expert weights gives. torchtitan's own ParallelDims / ``Module.parallelize`` route is not used."""
    if capacity_factor is not None:
        raise PeerUnavailable(
            "torchtitan 0.3.0's MoE is dropless only: its all-to-all dispatcher (AllToAllTokenDispatcher) "
            "has no capacity factor. The only capacity setting, HybridEPTokenDispatcher's "
            "non_blocking_capacity_factor, needs DeepEP's HybridEP kernels")
    if activation != "swiglu":
        raise PeerUnavailable(f"torchtitan's GroupedExperts is SwiGLU only (w1, w3, silu, w2); {activation!r} "
                              "experts are not offered")
    moe_mod, disp_mod, lin_mod, utils_mod = _import(
        "torchtitan", ("torchtitan.models.common.moe", "torchtitan.models.common.token_dispatcher",
                       "torchtitan.models.common.linear", "torchtitan.distributed.utils"), "torchtitan==0.3.0")
    if world_size > 1 or dist.is_initialized():  # one process without torch.distributed is fine here
        _check_distributed(world_size)
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):  # used by the dispatcher; not in torch 2.11
        torch.compiler._is_non_strict_tracing = lambda: False
        _TORCH_SHIMS.append("torch.compiler._is_non_strict_tracing (absent in this torch) shimmed to False")
    # "partial_dtensor" sends the dispatcher down plain funcol all_to_all_single on its EP mesh.
    # The default, "spmd_types", needs meshes that only torchtitan's trainer registers.
    utils_mod.set_spmd_backend("partial_dtensor")

    num_local = num_experts // world_size
    config = moe_mod.MoE.Config(
        num_experts=num_experts,
        load_balance_coeff=None,  # no expert-bias load balancing: the layer function alone
        router=moe_mod.TokenChoiceTopKRouter.Config(
            num_experts=num_experts, top_k=top_k, score_func="softmax", route_norm=True,
            gate=lin_mod.Linear.Config(in_features=dim, out_features=num_experts, bias=False)),
        routed_experts=moe_mod.RoutedExperts.Config(
            inner_experts=moe_mod.GroupedExperts.Config(dim=dim, hidden_dim=hidden_dim, num_experts=num_local),
            token_dispatcher=disp_mod.AllToAllTokenDispatcher.Config(num_experts=num_experts, top_k=top_k)),
    )
    with torch.device(device):
        moe = config.build()
    experts = moe.routed_experts.inner_experts
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device=device).manual_seed(_SEED + 7919 * rank)
    with torch.no_grad():
        for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD):
            w.normal_(0.0, _INIT_STD, generator=gen)
        for p in moe.parameters():  # buffers (token counts) stay float32
            p.data = p.data.to(dtype)
    mesh = None
    if world_size > 1:
        key = (device.type, world_size)
        if key not in _EP_MESHES:
            from torch.distributed.device_mesh import init_device_mesh
            _EP_MESHES[key] = init_device_mesh(device.type, (world_size,), mesh_dim_names=("ep",))
        mesh = _EP_MESHES[key]
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)

    def run(x: torch.Tensor) -> torch.Tensor:
        return moe(x.reshape(1, x.shape[0], x.shape[1])).reshape(x.shape)

    description = (
        f"torchtitan {_version('torchtitan')} MoE (torchtitan.models.common.moe), dropless: "
        f"TokenChoiceTopKRouter softmax top-{top_k} with route_norm (gate under fp32 autocast), no expert-bias "
        f"balancing; GroupedExperts SwiGLU on torch._grouped_mm in bf16, {num_local} local of {num_experts} "
        f"experts, params {str(dtype).replace('torch.', '')}; "
        + (f"AllToAllTokenDispatcher over a 1-D 'ep' DeviceMesh of {world_size} ranks (funcol "
           "all_to_all_single with host-synced split sizes, spmd_backend=partial_dtensor)"
           if mesh is not None else "LocalTokenDispatcher path (EP=1, no all-to-all)")
        + "; experts sharded by hand (no ParallelDims/FSDP/compile)"
        + "".join(f"; {s}" for s in _TORCH_SHIMS))
    return PeerLayer(moe, description, run)


# -- Megatron-Core ---------------------------------------------------------------------------

_MOE_NEEDS_CUDA = ("Megatron-Core's MoELayer needs CUDA (it allocates on torch.cuda.current_device() and copies "
                   "split sizes on a CUDA side stream)")


def _require_cuda(device: torch.device, message: str = _MOE_NEEDS_CUDA) -> None:
    if device.type != "cuda":
        raise PeerUnavailable(message)


def _megatron_parallel_state(parallel_state, tensor_parallel, device: torch.device, tp: int = 1, ep: int = 1) -> None:
    """Megatron's groups: tensor parallel over `tp` ranks and expert parallel over `ep` (PP = 1),
    set up once per process (again when the sizes change). Reseeding Megatron's RNG tracker
    leaves the caller's CUDA RNG state as it was."""
    ready = parallel_state.model_parallel_is_initialized()
    if ready and (parallel_state.get_expert_model_parallel_world_size() != ep
                  or parallel_state.get_tensor_model_parallel_world_size() != tp):
        parallel_state.destroy_model_parallel()
        ready = False
    if not ready:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep, create_gloo_process_groups=False)
    rng = torch.cuda.get_rng_state(device)
    tensor_parallel.model_parallel_cuda_manual_seed(_SEED)
    torch.cuda.set_rng_state(rng, device)


def _build_megatron(dim, hidden_dim, num_experts, top_k, capacity_factor, activation, dtype, device,
                    world_size) -> PeerLayer:
    """Megatron-Core's MoELayer from the local (no Transformer Engine) spec: TopKRouter,
    MoEAlltoAllTokenDispatcher and SequentialMLP experts, with EP over all ranks."""
    ps, tp, cfg_mod, specs = _import(
        "megatron.core", ("megatron.core.parallel_state", "megatron.core.tensor_parallel",
                          "megatron.core.transformer.transformer_config", "megatron.core.models.gpt.moe_module_specs"),
        "megatron-core==0.19.2")
    _require_cuda(device)
    _check_distributed(world_size)
    torch.cuda.set_device(device)
    _megatron_parallel_state(ps, tp, device, ep=world_size)

    act = {"relu": torch.nn.functional.relu, "gelu": torch.nn.functional.gelu,
           "silu": torch.nn.functional.silu, "swiglu": torch.nn.functional.silu}[activation]
    padded = capacity_factor is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cfg_mod.TransformerConfig(
            num_layers=1, hidden_size=dim, num_attention_heads=1,  # attention is not built
            ffn_hidden_size=hidden_dim, moe_ffn_hidden_size=hidden_dim,
            num_moe_experts=num_experts, moe_router_topk=top_k,
            moe_router_pre_softmax=top_k == 1,  # Megatron requires it for top-1 softmax routing
            moe_router_score_function="softmax", moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=padded,
            moe_token_drop_policy="probs",
            moe_grouped_gemm=False,  # grouped GEMM experts (TEGroupedMLP) need Transformer Engine
            moe_permute_fusion=False, moe_router_fusion=False,
            activation_func=act, gated_linear_unit=activation == "swiglu",
            add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
            hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=world_size,
            sequence_parallel=False,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            init_method_std=_INIT_STD, use_cpu_initialization=False, perform_initialization=True,
        )
        spec = specs.get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
        layer = spec(config=config)
    layer.to(device)  # the router weight is created on the CPU

    def run(x: torch.Tensor) -> torch.Tensor:
        out, bias = layer(x.reshape(x.shape[0], 1, x.shape[1]))  # Megatron's layout is [S, B, D]
        if bias is not None:
            out = out + bias
        return out.reshape(x.shape)

    if padded:
        capacity = (f"capacity factor {capacity_factor:g}: per source rank and expert "
                    f"ceil(T*{top_k}/{num_experts}*{capacity_factor:g}) slots, tokens over it dropped (probs "
                    "policy), expert inputs padded to capacity (fixed-size all-to-all, no host sync)")
    else:
        capacity = "dropless (variable all-to-all splits, host sync for the split sizes)"
    act_desc = "swiglu (gated_linear_unit, silu)" if activation == "swiglu" else activation
    description = (
        f"Megatron-Core {_version('megatron-core')} MoELayer, local spec without Transformer Engine: "
        f"TopKRouter softmax top-{top_k} (fp32 router, no aux loss), MoEAlltoAllTokenDispatcher over EP={world_size} "
        f"(TP=1, unfused permute), SequentialMLP experts ({num_experts // world_size} local; a per-expert loop of "
        f"ColumnParallelLinear/RowParallelLinear, no grouped GEMM), activation {act_desc}, no bias, "
        f"params {str(dtype).replace('torch.', '')}; {capacity}")
    return PeerLayer(layer, description, run)


# -- tensor-parallel peers (weft bench tp) ----------------------------------------------------

TP_PEERS = ("megatron", "deepspeed")


def build_tp_peer(name: str, dim: int, n_head: int, hidden_dim: int, layers: int, seq_len: int, norm_eps: float,
                  rope_theta: float, dtype: torch.dtype, device: torch.device | str,
                  world_size: int) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], str]:
    """Tensor-parallel peer `name` (`TP_PEERS`): (module, run, description), `run(x)` mapping
    weft's (batch, seq, dim) to (batch, seq, dim) through `layers` blocks split over all
    `world_size` ranks. Raises `PeerUnavailable` where it cannot run."""
    if name not in TP_PEERS:
        raise ValueError(f"unknown tensor-parallel peer {name!r}; choose from {TP_PEERS}")
    if dim % n_head or n_head % world_size or hidden_dim % world_size:
        raise ValueError(f"heads ({n_head}) and MLP width ({hidden_dim}) must split over {world_size} ranks")
    build = _build_megatron_tp if name == "megatron" else _build_deepspeed_domino
    return build(dim, n_head, hidden_dim, layers, seq_len, norm_eps, rope_theta, dtype, torch.device(device),
                 world_size)


def _build_megatron_tp(dim, n_head, hidden_dim, layers, seq_len, norm_eps, rope_theta, dtype, device, world_size):
    """Megatron-Core's `TransformerBlock` of `layers` GPT layers from the local spec (no Transformer
    Engine): RMSNorm, causal self-attention with rotary q, k (`DotProductAttention`: unfused
    softmax), GELU MLP, no biases, no final norm, tensor parallel over all `world_size` ranks
    (Megatron's schedule: column- then row-parallel linears, one all-reduce after each sub-layer;
    no sequence parallelism)."""
    ps, tp, cfg_mod, block_mod, specs, rotary_mod = _import(
        "megatron.core", ("megatron.core.parallel_state", "megatron.core.tensor_parallel",
                          "megatron.core.transformer.transformer_config",
                          "megatron.core.transformer.transformer_block", "megatron.core.models.gpt.gpt_layer_specs",
                          "megatron.core.models.common.embeddings.rotary_pos_embedding"),
        "megatron-core==0.19.2")
    _require_cuda(device, "Megatron-Core's tensor-parallel layers need CUDA (they allocate on "
                          "torch.cuda.current_device() and fork its CUDA RNG tracker)")
    _check_distributed(world_size)
    torch.cuda.set_device(device)
    _megatron_parallel_state(ps, tp, device, tp=world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = cfg_mod.TransformerConfig(
            num_layers=layers, hidden_size=dim, num_attention_heads=n_head, ffn_hidden_size=hidden_dim,
            normalization="RMSNorm", layernorm_epsilon=norm_eps, activation_func=torch.nn.functional.gelu,
            gated_linear_unit=False, add_bias_linear=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
            tensor_model_parallel_size=world_size, pipeline_model_parallel_size=1, sequence_parallel=False,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            init_method_std=_INIT_STD, use_cpu_initialization=False, perform_initialization=True,
        )
        block = block_mod.TransformerBlock(config, specs.get_gpt_layer_local_spec(normalization="RMSNorm"),
                                           post_layer_norm=False)
        # the local spec's norms are torch modules built on the CPU in float32; Megatron's own
        # training moves and casts the whole model (Float16Module), so do the same
        block = block.to(device=device, dtype=dtype)
        rotary = rotary_mod.RotaryEmbedding(kv_channels=dim // n_head, rotary_percent=1.0,
                                            rotary_base=int(rope_theta))
    rope = rotary(seq_len)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = block(x.transpose(0, 1), attention_mask=None, rotary_pos_emb=rope)  # Megatron's layout: [S, B, D]
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1)

    description = (f"Megatron-Core {_version('megatron-core')} TransformerBlock, local spec without Transformer "
                   f"Engine: {layers} layers, TP={world_size} (column/row-parallel linears, an all-reduce per "
                   f"sub-layer, no sequence parallelism), unfused attention and softmax, torch RMSNorm, GELU MLP, "
                   f"no bias, params {str(dtype).replace('torch.', '')}")
    return block, run, description


class _WorldTP:
    """The model-parallel unit DeepSpeed's Domino asks for its tensor-parallel group: the world."""

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return dist.get_world_size()

    @staticmethod
    def get_tensor_model_parallel_group():
        return dist.group.WORLD


def _rotate(t: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """DeepSpeed's rotary hook: weft's own rotation of t (..., seq, head_dim) by (cos, sin)."""
    return apply_rotary(t, *tables)


def _build_deepspeed_domino(dim, n_head, hidden_dim, layers, seq_len, norm_eps, rope_theta, dtype, device,
                            world_size):
    """DeepSpeed's Domino transformer (`DominoTransformer`, inter-layer overlap): the batch in 2
    micro-batches whose all-reduces run asynchronously under the other's computation, LayerNorm,
    fused causal attention (SDPA), GELU MLP, no biases, no final norm, TP over all ranks."""
    (domino,) = _import("deepspeed", ("deepspeed.runtime.domino.transformer",), "deepspeed==0.19.8")
    _check_distributed(world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def init(weight: torch.Tensor) -> torch.Tensor:
        return nn.init.normal_(weight, 0.0, _INIT_STD)

    config = SimpleNamespace(  # the fields DeepSpeed's Domino reads (Megatron's names)
        num_layers=layers, hidden_size=dim, num_attention_heads=n_head, kv_channels=dim // n_head,
        ffn_hidden_size=hidden_dim, gated_linear_unit=False, add_bias_linear=False, layernorm_epsilon=norm_eps,
        apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, perform_initialization=True, init_method=init, output_layer_init_method=init,
        domino_intra_layer_overlap=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = domino.DominoTransformer(config, _WorldTP(), _rotate, domino.ModelType.encoder_or_decoder,
                                         post_layer_norm=False).to(device=device, dtype=dtype)  # its norms: fp32
    tables = rotary_tables(seq_len, dim // n_head, rope_theta, device)

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2:
            raise ValueError(f"DeepSpeed's Domino splits the batch in 2: batch {x.shape[0]} is odd")
        # its layout is [S, B, D]; a pair of embeddings is read as (queries', keys')
        return block(x.transpose(0, 1), None, rotary_pos_emb=(tables, tables)).transpose(0, 1)

    description = (f"DeepSpeed {_version('deepspeed')} Domino (DominoTransformer, inter-layer overlap): {layers} "
                   f"layers, TP={world_size}, the batch in 2 micro-batches with asynchronous all-reduces, "
                   f"LayerNorm, SDPA causal attention, GELU MLP, no bias, params {str(dtype).replace('torch.', '')}")
    return block, run, description
