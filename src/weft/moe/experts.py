"""Expert FFN weights and their computation.

Weights are stacked per local expert: w1 (El, dim, hidden), w2 (El, hidden, dim) and, for
swiglu, w3 (El, dim, hidden). With fewer experts than ranks (Tutel's switchable parallelism),
a rank holds one shard of one expert: the hidden columns [j * h, (j + 1) * h), h = hidden / m.
Padded layouts compute with one batched matmul, or, on the rows as an all-to-all delivers them
(by source rank, then expert), with one batched matmul per source into one buffer
(`forward_by_source`: no layout copies); dropless (variable rows per expert) with grouped GEMM on
GPUs that have it, a per-expert loop elsewhere.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from weft.hostcopy import offsets
from weft.kernels.activation import activate
from weft.kernels.grouped_mm import (
    batched_wgrad_into,
    grouped_mm_on,
    grouped_rows_mm,
    grouped_weights_mm,
    leave_sms,
    use_grouped_mm,
)
from weft.kernels.grouped_wgrad import grouped_wgrad, grouped_wgrad_into, grouped_wgrad_takes
from weft.moe.backward_sgd import BackwardSGD
from weft.ops import wgrad
from weft.profiling import stage


@dataclass(frozen=True)
class PartCall:
    """How one call of a `GroupedWeightGradParts` runs its matmuls.

    sm_margin: SMs they leave to the kernels of other streams (an exchange beside them:
        `weft.kernels.grouped_mm.leave_sms`); 0 where nothing runs beside them.
    weight_grad_now: its backward computes its share of each weight's gradient at once (one
        grouped product over its own rows), which the tap adds to the others'; else it keeps its
        rows for the tap's product. For a call whose backward runs under an exchange that the
        product helps to fill (a rank's own pairs: `weft.moe.dedup`)."""

    sm_margin: int = 0
    weight_grad_now: bool = False


class Experts(nn.Module):
    """The `num_local` experts of this rank; global expert ids `first_expert + i`.

    Initialisation depends only on the global expert id and one seed drawn from torch's RNG,
    so the full set of experts is the same whatever the expert-parallel size. `shard=(j, m)`
    keeps only shard j of m of each expert's hidden dimension (the same values as unsharded).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_local: int,
        activation: str = "gelu",
        first_expert: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shard: tuple[int, int] = (0, 1),
    ):
        super().__init__()
        self.dim, self.hidden_dim, self.num_local, self.activation = dim, hidden_dim, num_local, activation
        self.first_expert = first_expert
        self.shard_index, self.num_shards = shard
        if hidden_dim % self.num_shards or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard {shard} does not split hidden_dim {hidden_dim} evenly")
        width = hidden_dim // self.num_shards
        factory = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(num_local, dim, width, **factory))
        self.w2 = nn.Parameter(torch.empty(num_local, width, dim, **factory))
        if activation == "swiglu":
            self.w3 = nn.Parameter(torch.empty(num_local, dim, width, **factory))
        else:
            self.register_parameter("w3", None)
        # Lancet's backward pass (weft.overlap): a WGradScheduler here defers each local
        # expert's weight gradients so they can run while an all-to-all is in flight.
        self.wgrad_scheduler = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) per expert from a generator seeded by its global id.

        Values depend on the device type's generator (CPU or CUDA), not on the EP size.
        """
        seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        if self.w1.device.type == "meta":
            return
        width, start = self.w1.shape[-1], self.shard_index * self.w1.shape[-1]
        for i in range(self.num_local):
            gen = torch.Generator(device=self.w1.device).manual_seed(seed + self.first_expert + i)
            for w, fan_in, axis in ((self.w1, self.dim, 1), (self.w2, self.hidden_dim, 0), (self.w3, self.dim, 1)):
                if w is None:
                    continue
                bound = 1.0 / math.sqrt(fan_in)
                full = list(w.shape[1:])
                full[axis] = self.hidden_dim
                # Draw the whole expert, keep the shard: values do not depend on the sharding.
                values = torch.empty(full, dtype=w.dtype, device=w.device).uniform_(-bound, bound, generator=gen)
                with torch.no_grad():
                    w[i].copy_(values.narrow(axis, start, width))

    def _hidden(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        return activate(self.activation, h1, h3)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.w1, self.w2, self.w3

    def forward(self, x: torch.Tensor, weights: tuple | None = None, step: BackwardSGD | None = None) -> torch.Tensor:
        """Padded layout: x (G, M, dim) -> (G, M, dim), one bmm per weight. `weights` (w1, w2, w3)
        stacked over G experts replaces this rank's own (e.g. all experts, gathered). `step`: the
        call's `BackwardSGD`, which steps this rank's own weights in their gradient GEMMs
        (`SteppedMm`)."""
        with stage("experts"):
            w1, w2, w3 = weights or self.weights()
            x = x.to(self.compute_dtype(x))
            if step is not None and weights is None and self.wgrad_scheduler is None:
                w1, w2, w3 = in_dtype((w1, w2, w3), x.dtype)
                with torch.autocast(x.device.type, enabled=False):
                    def stepped(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                        return SteppedMm.apply(rows, w, step, FlexibleProducts())

                    h3 = stepped(x, w3) if w3 is not None else None
                    return stepped(self._hidden(stepped(x, w1), h3), w2)
            if self.wgrad_scheduler is not None and weights is None:
                mm = functools.partial(wgrad.bmm, scheduler=self.wgrad_scheduler)
            else:
                mm = torch.bmm
            h3 = mm(x, w3) if w3 is not None else None
            return mm(self._hidden(mm(x, w1), h3), w2)

    def forward_by_source(self, x_WGCD: torch.Tensor, step: BackwardSGD | None = None) -> torch.Tensor:
        """Padded rows as the exchange's all-to-all delivers them: (W, G, C, dim), source rank w's
        C slots of local expert g at [w, g] -> the outputs in the same layout (contiguous, ready to
        go back). The same function as `forward` on Tutel's Flexible layout (G, W * C, dim): where
        `by_source_pays`, without the layout copies into it and out of it (two in forward, two
        more in backward, each of the whole (W * G * C, dim) rows): each weight's matmul runs once
        per source into one buffer, `source_major_bmm`. Otherwise, and where Lancet defers the
        weight gradients (`wgrad_scheduler`, which schedules the Flexible layout's matmuls), the
        rows are copied into the Flexible layout and back. `step` (a `BackwardSGD`) steps the
        weights in the Flexible layout's products (`forward`); the per-source products, whose rows
        are no one matrix per expert, leave them their gradients."""
        W, G, C, D = x_WGCD.shape
        if W == 1:  # one source: its rows are already expert-major
            return self(x_WGCD.view(G, C, D), step=step).view(W, G, C, D)
        num_weights = sum(w is not None for w in self.weights())
        if self.wgrad_scheduler is not None or not by_source_pays(W, C, self.w1.shape[-1], num_weights):
            flexible = x_WGCD.transpose(0, 1).reshape(G, W * C, D)
            return self(flexible, step=step).view(G, W, C, D).transpose(0, 1).contiguous()
        with stage("experts"):
            dtype = self.compute_dtype(x_WGCD)
            w1, w2, w3 = (None if w is None else w.to(dtype) for w in self.weights())
            with torch.autocast(x_WGCD.device.type, enabled=False):
                x = x_WGCD.to(dtype)
                h3 = source_major_bmm(x, w3) if w3 is not None else None
                return source_major_bmm(self._hidden(source_major_bmm(x, w1), h3), w2)

    def forward_part(self, x: torch.Tensor, parts: WeightGradParts) -> torch.Tensor:
        """Padded layout like `forward`, as one of `parts.count` calls on different rows in one
        backward: each call's backward computes its input gradient, and the last to run computes
        each weight's gradient once for all of them (`WeightGradParts`)."""
        with stage("experts"):
            with torch.autocast(x.device.type, enabled=False):
                x = x.to(parts.dtype)
                w1, w2, w3 = parts.weights
                h3 = parts.bmm(x, w3) if w3 is not None else None
                return parts.bmm(self._hidden(parts.bmm(x, w1), h3), w2)

    def forward_grouped(self, x: torch.Tensor, counts: list[int], weights: tuple | None = None,
                        step: BackwardSGD | None = None) -> torch.Tensor:
        """Dropless layout: rows of x (M, dim) sorted by expert, `counts[i]` rows each. `step`: the
        call's `BackwardSGD`, which steps this rank's own weights in their gradient GEMMs
        (`SteppedMm`)."""
        with stage("experts"):
            return self._forward_grouped(x, counts, weights, step)

    def _forward_grouped(self, x: torch.Tensor, counts: list[int], weights: tuple | None,
                         step: BackwardSGD | None = None) -> torch.Tensor:
        w1, w2, w3 = weights or self.weights()
        x = x.to(self.compute_dtype(x))
        if weights is None and self._steps_grouped(step, x):
            return self._stepped_gemms(x, offsets(counts, x.device), step)
        if self.wgrad_scheduler is not None and weights is None:
            mm = functools.partial(wgrad.grouped_mm, counts=counts, scheduler=self.wgrad_scheduler)
            h3 = mm(x, w3) if w3 is not None else None
            return mm(self._hidden(mm(x, w1), h3), w2)
        w1, w2, w3 = in_dtype((w1, w2, w3), x.dtype)
        if use_grouped_mm(x, w1, w2):
            return self._grouped_gemms(x, offsets(counts, x.device), (w1, w2, w3))
        return grouped_mm_reference(x, counts, self, (w1, w2, w3))

    def _grouped_gemms(self, x: torch.Tensor, offs_E: torch.Tensor, weights: tuple) -> torch.Tensor:
        """The experts on rows grouped by expert, ending at `offs_E` (int32, on the device), by
        torch._grouped_mm (rows past the last end are left unwritten)."""
        w1, w2, w3 = weights
        h1 = torch._grouped_mm(x, w1, offs=offs_E)
        h3 = torch._grouped_mm(x, w3, offs=offs_E) if w3 is not None else None
        return torch._grouped_mm(self._hidden(h1, h3), w2, offs=offs_E)

    def _steps_grouped(self, step: BackwardSGD | None, x: torch.Tensor) -> bool:
        """Whether this rank's own weights on grouped rows x run as `SteppedMm` products: a step to
        take, no Lancet scheduler (it defers the weight gradients), and on CUDA the grouped GEMM
        (elsewhere the per-group products would read the groups' ends back from the device)."""
        w1 = self.w1
        return step is not None and self.wgrad_scheduler is None and (
            not x.is_cuda or grouped_mm_on(w1.device, x.dtype, w1.shape[1], w1.shape[2]))

    def _stepped_gemms(self, x: torch.Tensor, offs_E: torch.Tensor, step: BackwardSGD) -> torch.Tensor:
        """The experts on rows grouped by expert, each product a `SteppedMm`: its backward
        makes the rows' gradient, then steps the weight (or makes its gradient where it cannot)."""
        w1, w2, w3 = in_dtype(self.weights(), x.dtype)

        def mm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return SteppedMm.apply(rows, w, step, GroupedProducts(offs_E))

        h3 = mm(x, w3) if w3 is not None else None
        return mm(self._hidden(mm(x, w1), h3), w2)

    def forward_offsets(self, x: torch.Tensor, offs_E: torch.Tensor, step: BackwardSGD | None = None) -> torch.Tensor:
        """Dropless rows grouped by local expert in a buffer of fixed size, the groups' ends on the
        device: expert e's rows are x[offs_E[e - 1]:offs_E[e]] (int32, offs_E[-1] <= rows). Rows
        from offs_E[-1] on are padding: their outputs are undefined (grouped GEMM leaves them
        unwritten) and no caller may read them. With grouped GEMM on the GPU nothing is read on
        the host, so a CUDA graph captures the call; elsewhere (the CPU reference, fp32, Lancet's
        deferred weight gradients) the counts are read from `offs_E` and the padding is zeros."""
        with stage("experts"):
            w1, w2, w3 = self.weights()
            x = x.to(self.compute_dtype(x))
            if self._steps_grouped(step, x):
                return self._stepped_gemms(x, offs_E, step)
            if self.wgrad_scheduler is None:
                cast = in_dtype((w1, w2, w3), x.dtype)
                if use_grouped_mm(x, cast[0], cast[1]):
                    return self._grouped_gemms(x, offs_E, cast)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"a CUDA graph of fixed-size dropless experts needs torch._grouped_mm (bfloat16 on "
                                 f"sm90+, 8-aligned widths); these run {x.dtype} on {x.device}, which reads the "
                                 "counts on the host")
            ends = offs_E.tolist()
            counts = [b - a for a, b in zip([0] + ends, ends)]
            out = self._forward_grouped(x[:ends[-1]], counts, None, step)
            return torch.cat([out, out.new_zeros(x.shape[0] - ends[-1], out.shape[1])])

    def offsets_stay_on_device(self, dtype: torch.dtype) -> bool:
        """Whether `forward_offsets` on rows of `dtype` reads nothing on the host (the grouped GEMM
        on the GPU, no Lancet scheduler), so that a CUDA graph can hold it."""
        w1 = self.w1
        return self.wgrad_scheduler is None and grouped_mm_on(w1.device, dtype, w1.shape[1], w1.shape[2])

    def forward_offsets_part(self, x: torch.Tensor, offs_E: torch.Tensor, parts: GroupedWeightGradParts,
                             weights: tuple[torch.Tensor | None, ...], call: PartCall = PartCall()) -> torch.Tensor:
        """`forward_offsets` as one of `parts.count` calls on different rows in one backward (the
        chunks of a pipelined fixed-size exchange, or a rank's own pairs and the others'), on
        `weights = parts.tapped()`: each call's backward computes its input gradient, and the
        weights' gradients come from the tap's backward (`GroupedWeightGradParts`); `call` says
        how this call's matmuls run (`PartCall`)."""
        with stage("experts"):
            with torch.autocast(x.device.type, enabled=False):
                x = x.to(parts.dtype)
                w1, w2, w3 = weights
                h3 = parts.mm(x, w3, offs_E, 2, call) if w3 is not None else None
                return parts.mm(self._hidden(parts.mm(x, w1, offs_E, 0, call), h3), w2, offs_E, 1, call)

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.w1.dtype


def by_source_pays(sources: int, slots: int, hidden: int, num_weights: int) -> bool:
    """Whether the experts' per-source matmuls (`Experts.forward_by_source`) move fewer bytes than
    Tutel's Flexible layout. The layout's four copies read and write the W * G * C rows of `dim`
    values: 8 W G C dim elements; the per-source weight gradient reads and writes each of the
    `num_weights` (G, dim, hidden) gradients W - 1 more times (`baddbmm_`): 2 (W - 1) G dim hidden
    each. The per-source path pays when 4 W C > (W - 1) hidden num_weights: with many slots per
    expert (a training batch: qwen2-moe-2l's 2,560; the qwen2 layer at 16,384 tokens), not where
    the experts' weights outweigh the rows (the layer benchmark's qwen2 / phi35 / mixtral at 4,096
    tokens: 256 / 512 / 1,024 slots, where it measured 1-5% slower; docs/benchmarks.md)."""
    return 4 * sources * slots > (sources - 1) * hidden * num_weights


class _SourceMajorBmm(torch.autograd.Function):
    """y[w] = x[w] @ b for every source w: x (W, G, M, K), b (G, K, N) -> y (W, G, M, N).

    One `torch.bmm` per source, each writing its slice of one contiguous output; backward the
    same for dx (dy[w] @ b^T), and db = sum over w of x[w]^T @ dy[w] (the first product, then
    `baddbmm_` of the others: the sum over a Flexible layout's W * M rows in W pieces, the same to
    the rounding of W - 1 partial sums)."""

    @staticmethod
    def forward(ctx, x_WGMK, b_GKN):
        y_WGMN = x_WGMK.new_empty(x_WGMK.shape[:-1] + (b_GKN.shape[-1],))
        for w in range(x_WGMK.shape[0]):
            torch.bmm(x_WGMK[w], b_GKN, out=y_WGMN[w])
        ctx.save_for_backward(x_WGMK, b_GKN)
        return y_WGMN

    @staticmethod
    def backward(ctx, dy_WGMN):
        x_WGMK, b_GKN = ctx.saved_tensors
        dy_WGMN = dy_WGMN.contiguous()
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x_WGMK)
            for w in range(x_WGMK.shape[0]):
                torch.bmm(dy_WGMN[w], b_GKN.transpose(1, 2), out=dx[w])
        if ctx.needs_input_grad[1]:
            db = torch.bmm(x_WGMK[0].transpose(1, 2), dy_WGMN[0])
            for w in range(1, x_WGMK.shape[0]):
                db.baddbmm_(x_WGMK[w].transpose(1, 2), dy_WGMN[w])
        return dx, db


class WeightGradParts:
    """The weight gradients of `count` calls of the same experts on different rows, summed in
    their matmuls instead of after them.

    Autograd gives a weight used by two calls two full-size gradients and adds them: for the
    qwen2-like layer's (32, 2048, 1408) bf16 weights two adds of 177 us each on an H100, more than
    the matmuls of one call (docs/benchmarks.md). Here each call's backward computes only its
    input gradient and keeps its (x, dy); the last of the `count` calls to run backward computes
    dW = x^T dy in one matmul over all the calls' rows (their copies into one buffer cost less
    than the matmuls' in-place sum, `baddbmm_`, which ran at twice a matmul's time on the
    qwen2-like layer), returned as that call's gradient and none from the others.

    Invariants: all `count` calls run backward in the same backward pass (each call's output
    feeds the loss), else the gradient is not produced; the weights are cast once to the compute
    `dtype`, shared by the calls."""

    def __init__(self, experts: Experts, count: int, dtype: torch.dtype):
        self.count, self.dtype = count, dtype
        self.weights = _cast_weights(experts, dtype)
        self._kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def bmm(self, x_GMK: torch.Tensor, b_GKN: torch.Tensor) -> torch.Tensor:
        return _PartBmm.apply(x_GMK, b_GKN, self)

    def weight_grad(self, x_GMK: torch.Tensor, b_GKN: torch.Tensor, dy_GMN: torch.Tensor) -> torch.Tensor | None:
        """Keeps this call's (x, dy) for `b`; the sum over all calls once the last has come."""
        kept = self._kept.setdefault(id(b_GKN), [])
        kept.append((x_GMK, dy_GMN))
        if len(kept) < self.count:
            return None
        del self._kept[id(b_GKN)]
        x_GMK = torch.cat([x for x, _ in kept], dim=1)
        dy_GMN = torch.cat([dy for _, dy in kept], dim=1)
        return torch.bmm(x_GMK.transpose(1, 2), dy_GMN)


def _cast_weights(experts: Experts, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    """(w1, w2, w3) in the compute dtype, cast once for every call that shares them."""
    return tuple(None if w is None else w.to(dtype) for w in experts.weights())


@dataclass(frozen=True)
class FlexibleProducts:
    """`SteppedMm`'s products on (G, M, K) rows, one matrix per expert (Tutel's Flexible layout):
    cuBLAS's bmm, the step in `baddbmm_`'s epilogue (beta = 1 - lr wd, alpha = -lr into w)."""

    def product(self, x_GMK: torch.Tensor, w_GKN: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x_GMK, w_GKN)

    def weight_grad(self, x_GMK: torch.Tensor, dy_GMN: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x_GMK.transpose(1, 2), dy_GMN)

    def step_into(self, w_GKN: torch.Tensor, x_GMK: torch.Tensor, dy_GMN: torch.Tensor, alpha: float,
                  beta: float) -> bool:
        return batched_wgrad_into(w_GKN, x_GMK, dy_GMN, alpha, beta)


@dataclass(frozen=True)
class GroupedProducts:
    """`SteppedMm`'s products on (M, K) rows grouped by expert, group g's ending at `offs_G[g]`
    (`grouped_rows_mm`: rows from offs[-1] on are padding): the step in the grouped
    weight-gradient kernel's epilogue (`grouped_wgrad` into w) where it runs."""

    offs_G: torch.Tensor

    def product(self, x_MK: torch.Tensor, w_GKN: torch.Tensor) -> torch.Tensor:
        return grouped_rows_mm(x_MK, w_GKN, self.offs_G)

    def weight_grad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor) -> torch.Tensor:
        return grouped_weights_mm(x_MK, dy_MN, self.offs_G)

    def step_into(self, w_GKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, alpha: float,
                  beta: float) -> bool:
        return grouped_wgrad_into(w_GKN, x_MK, dy_MN, self.offs_G, alpha, beta)


class SteppedMm(torch.autograd.Function):
    """y = x @ w per expert (`products`: `FlexibleProducts` or `GroupedProducts`), whose backward makes x's gradient
    first and then w's, which the call's `BackwardSGD` (`step`) takes in that product's epilogue
    (no gradient made, w stepped in place; nothing in this backward reads w after it); where it
    cannot (w a cast, not the optimizer's, no kernel for it) w gets its gradient and the
    optimizer's `step()` applies it."""

    @staticmethod
    def forward(ctx, x, w, step, products):
        ctx.save_for_backward(x, w)
        ctx.step, ctx.products = step, products
        return products.product(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        products, dy = ctx.products, dy.contiguous()
        dx = products.product(dy, w.transpose(-2, -1)) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1] or ctx.step.fuse(w, lambda alpha, beta: products.step_into(w, x, dy, alpha,
                                                                                                 beta)):
            return dx, None, None, None
        return dx, products.weight_grad(x, dy), None, None


class _PartBmm(torch.autograd.Function):
    """y = x @ b (bmm) whose weight gradient `WeightGradParts` sums over the calls."""

    @staticmethod
    def forward(ctx, x_GMK, b_GKN, parts):
        ctx.save_for_backward(x_GMK, b_GKN)
        ctx.parts = parts
        return torch.bmm(x_GMK, b_GKN)

    @staticmethod
    def backward(ctx, dy_GMN):
        x_GMK, b_GKN = ctx.saved_tensors
        dy_GMN = dy_GMN.contiguous()
        dx = torch.bmm(dy_GMN, b_GKN.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        db = ctx.parts.weight_grad(x_GMK, b_GKN, dy_GMN) if ctx.needs_input_grad[1] else None
        return dx, db, None


class GroupedWeightGradParts:
    """The weight gradients of `count` calls of the same experts on rows grouped by expert in
    buffers of a fixed size, the groups' ends on the device (`Experts.forward_offsets_part`: the
    chunks of a pipelined fixed-size exchange, or a rank's own pairs and the others'), returned
    once per weight after all of them.

    Each call's backward computes its input gradient and either keeps (x, dy, ends) or, with
    `PartCall.weight_grad_now`, computes its share of each weight's gradient at once. The
    weights' gradients come from the backward of `tapped()`, the node the calls take their
    weights from: one grouped GEMM per weight over every keeping call's rows (with several, taken
    by expert, stable: call order, then row order, every call's padding rows left out), plus the
    shares computed at once. One product per weight instead of `count` and the `count - 1`
    weight-sized adds autograd would make (phi35-like experts: 420 MB a weight on a rank of 2,
    ~1.3 GB read and written per add, estimated from the bytes); a share computed at once costs
    one such add, and buys a product placed under an exchange. Autograd runs ready nodes
    latest-created first, so the tap's backward runs after the backward of everything created
    after it: a pipeline creates it once its exchanges are launched, and the products run under
    the last gradient exchanges instead of before them (Lancet sec. 4's point: no backward op
    reads dW). Nothing is read on the host, so CUDA graphs capture it.

    `sm_margin`: SMs the tap's products leave to the exchange beside them
    (`weft.kernels.grouped_mm.leave_sms`). `fused` (the layer's Triton kernels, `use_triton`):
    where a share was computed at once, the tap's product starts from it and writes its sum there
    (`weft.kernels.grouped_wgrad`, its epilogue), instead of a separate weight-sized add.

    Invariants: every call runs backward in the same pass (each call's output feeds the loss),
    before the tap's; the weights are cast once to the compute `dtype`, shared by the calls."""

    def __init__(self, experts: Experts, count: int, dtype: torch.dtype, sm_margin: int = 0, fused: bool = False):
        self.count, self.dtype, self.sm_margin, self.fused = count, dtype, sm_margin, fused
        self.weights = _cast_weights(experts, dtype)
        self._kept: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._done: dict[int, list[torch.Tensor]] = {}

    def tapped(self) -> tuple[torch.Tensor | None, ...]:
        """The weights for the calls to take (None where the experts have none): views whose
        backward computes every weight's gradient from the calls' kept rows."""
        keys = [i for i, w in enumerate(self.weights) if w is not None]
        views = iter(_WeightsTap.apply(self, keys, *(self.weights[i] for i in keys)))
        return tuple(next(views) if i in keys else None for i in range(len(self.weights)))

    def mm(self, x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor, key: int,
           call: PartCall = PartCall()) -> torch.Tensor:
        """`grouped_rows_mm` whose weight gradient (of weight number `key`) the tap returns."""
        return _PartGroupedMM.apply(x_MK, w_GKN, offs_G, key, self, call)

    def keep(self, key: int, x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor) -> None:
        self._kept.setdefault(key, []).append((x_MK, dy_MN, offs_G))

    def keep_share(self, key: int, grad_GKN: torch.Tensor) -> None:
        """A call's share of weight `key`'s gradient, computed in its backward."""
        self._done.setdefault(key, []).append(grad_GKN)

    def weight_grad(self, key: int, groups: int) -> torch.Tensor:
        """Weight `key`'s gradient: the product over the rows every keeping call kept for it, plus
        the shares computed at once."""
        kept, done = self._kept.pop(key, []), self._done.pop(key, [])
        if len(kept) + len(done) != self.count:
            raise RuntimeError(f"GroupedWeightGradParts: {len(kept) + len(done)} of {self.count} calls ran backward "
                               "before their weights' gradient (every call's output must feed the loss)")
        with leave_sms(self.sm_margin):
            into = done.pop() if self.fused and kept and done and _takes_share(kept[0], done[-1]) else None
            grad_GKN = _kept_product(kept, groups, into, self.sm_margin) if kept else done.pop()
            for share in done:
                grad_GKN.add_(share)
        return grad_GKN


def _takes_share(kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor], share_GKN: torch.Tensor) -> bool:
    """Whether `grouped_wgrad` can add the tap's product into this share in its epilogue."""
    x_MK, dy_MN, _ = kept
    return (grouped_wgrad_takes(x_MK, dy_MN) and share_GKN.is_contiguous() and share_GKN.dtype == x_MK.dtype
            and share_GKN.shape == (share_GKN.shape[0], x_MK.shape[1], dy_MN.shape[1]))


def _kept_product(kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], groups: int,
                  into: torch.Tensor | None = None, sm_margin: int = 0) -> torch.Tensor:
    """x^T dy per group over the kept calls' rows: one call's buffer as it is; several taken by
    group into one buffer first. `into`: a share the product is added to, in place, by
    `grouped_wgrad` (persistent, leaving `sm_margin` SMs)."""
    if len(kept) == 1:
        x_MK, dy_MN, offs_G = kept[0]
    else:
        # each row's group (`groups` for padding), the calls' rows back to back
        group_R = torch.cat([torch.bucketize(torch.arange(x.shape[0], device=x.device), offs.long(), right=True)
                             for x, _, offs in kept])
        order_R = torch.argsort(group_R, stable=True)
        counts_G = torch.zeros(groups + 1, dtype=torch.long, device=group_R.device).scatter_add_(
            0, group_R, torch.ones_like(group_R))
        offs_G = torch.cumsum(counts_G[:groups], 0).to(torch.int32)
        # concatenated, then gathered (two passes; writing each call's rows to their places with
        # index_put_, one pass, ran slower: docs/benchmarks.md)
        x_MK = torch.cat([x for x, _, _ in kept]).index_select(0, order_R)
        dy_MN = torch.cat([dy for _, dy, _ in kept]).index_select(0, order_R)
    if into is not None:
        return grouped_wgrad(x_MK, dy_MN, offs_G, into=into, sm_margin=sm_margin)
    return grouped_weights_mm(x_MK, dy_MN, offs_G)


class _WeightsTap(torch.autograd.Function):
    """The weights as views (forward); backward: their gradients from `GroupedWeightGradParts`
    (the calls give none themselves)."""

    @staticmethod
    def forward(ctx, parts, keys, *weights):
        ctx.set_materialize_grads(False)  # the calls return no gradient: no weight-sized zeros
        ctx.parts, ctx.keys, ctx.groups = parts, keys, [w.shape[0] for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        del grads  # None: the calls keep their rows or shares instead
        return (None, None, *(ctx.parts.weight_grad(key, groups) if needed else None
                              for key, groups, needed in zip(ctx.keys, ctx.groups, ctx.needs_input_grad[2:])))


class _PartGroupedMM(torch.autograd.Function):
    """y = rows of x grouped by expert times their expert's w (`grouped_rows_mm`); backward
    computes the input gradient and keeps (x, dy) for `GroupedWeightGradParts`' tap, or its
    share of the weight gradient (`PartCall.weight_grad_now`)."""

    @staticmethod
    def forward(ctx, x_MK, w_GKN, offs_G, key, parts, call):
        ctx.save_for_backward(x_MK, w_GKN, offs_G)
        ctx.key, ctx.parts, ctx.call = key, parts, call
        with leave_sms(call.sm_margin):
            return grouped_rows_mm(x_MK, w_GKN, offs_G)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GKN, offs_G = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        with leave_sms(ctx.call.sm_margin):
            if ctx.needs_input_grad[1] and ctx.call.weight_grad_now:
                ctx.parts.keep_share(ctx.key, grouped_weights_mm(x_MK, dy_MN, offs_G))
            elif ctx.needs_input_grad[1]:
                ctx.parts.keep(ctx.key, x_MK, dy_MN, offs_G)
            dx = grouped_rows_mm(dy_MN, w_GKN.transpose(1, 2), offs_G) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None, None


def source_major_bmm(x_WGMK: torch.Tensor, b_GKN: torch.Tensor) -> torch.Tensor:
    """Differentiable x[w] @ b for every w (see `_SourceMajorBmm`); x contiguous, same dtype as b."""
    return _SourceMajorBmm.apply(x_WGMK.contiguous(), b_GKN)


def in_dtype(weights: tuple, dtype: torch.dtype) -> tuple:
    """The expert weight stacks in the matmuls' dtype, each cast once (None stays None): float32
    weights under bf16 autocast, which would cast every expert's slice in its own matmul (the same
    bf16 values). Cast whole, one grouped GEMM takes the stack and its backward casts the gradient
    back in one pass; sliced per expert, each slice's backward writes a zero gradient of the whole
    stack and adds it in (2 x E passes over each stack: on 4 H100s ~22 ms of a 93 ms qwen2-moe-2l
    step with float32 weights, docs/benchmarks.md, eighteenth session)."""
    return tuple(w if w is None or w.dtype == dtype else w.to(dtype) for w in weights)


def grouped_mm_reference(x: torch.Tensor, counts: list[int], experts: Experts,
                         weights: tuple | None = None) -> torch.Tensor:
    """Per-expert loop over the row groups: the plain-PyTorch oracle for grouped GEMM. Each stack
    is unbound once, so its backward stacks the experts' gradients in one pass (indexing it per
    expert would write a zero gradient of the whole stack for every expert and add them up)."""
    w1, w2, w3 = (None if w is None else w.unbind(0) for w in (weights or experts.weights()))
    outs = []
    for i, rows in enumerate(torch.split(x, counts)):
        h3 = rows @ w3[i] if w3 is not None else None
        outs.append(experts._hidden(rows @ w1[i], h3) @ w2[i])
    return torch.cat(outs) if outs else x.new_zeros(0, experts.dim)
