"""`Experts.forward_offsets`: dropless rows grouped by expert in a buffer of fixed size, the
groups' ends on the device (`a2a_algo="dedup-fixed"`). On the CPU the reference reads the ends;
its groups must compute what `forward_grouped` computes on the same rows, the padding rows
none of the gradients."""
from __future__ import annotations

import pytest
import torch

from weft.moe.experts import Experts

LOCAL, DIM, HIDDEN = 3, 8, 12
COUNTS, PADDING = [4, 0, 5], 6


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_the_groups_compute_as_forward_grouped_and_the_padding_adds_nothing(activation):
    torch.manual_seed(0)
    experts = Experts(DIM, HIDDEN, LOCAL, activation=activation, dtype=torch.float64)
    rows = sum(COUNTS)
    x = torch.randn(rows + PADDING, DIM, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(rows + PADDING, DIM, dtype=torch.float64)
    params = list(experts.parameters())
    ends = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    y = experts.forward_offsets(x, ends)
    got = torch.autograd.grad(y, [x, *params], dy)
    want_y = experts.forward_grouped(x[:rows], COUNTS)
    want = torch.autograd.grad(want_y, [x, *params], dy[:rows])
    assert y.shape == x.shape and torch.equal(y[:rows], want_y)
    assert torch.equal(y[rows:], torch.zeros(PADDING, DIM, dtype=torch.float64))
    assert torch.equal(got[0][rows:], torch.zeros(PADDING, DIM, dtype=torch.float64))  # the padding's gradient
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12)


def test_a_graph_capture_of_the_read_path_is_refused_in_one_line(monkeypatch):
    """Where grouped GEMM cannot run (fp32, the CPU, an old GPU) the ends are read on the host,
    which a CUDA graph cannot capture: said in one line, not a CUDA error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    experts = Experts(DIM, HIDDEN, LOCAL, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs torch._grouped_mm"):
        experts.forward_offsets(torch.randn(10, DIM), torch.tensor([2, 4, 9], dtype=torch.int32))


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_calls_sharing_grouped_weight_grad_parts_compute_each_weight_gradient_once(activation, monkeypatch):
    """`forward_offsets_part`: three calls on buffers of their own (their own ends and padding) that
    share `GroupedWeightGradParts` give the gradients of three `forward_offsets` calls, autograd
    summing their weight gradients; the parts' tap computes each weight's gradient in one grouped
    product over every call's rows (one product per weight, its groups' ends those of all the
    calls' rows together)."""
    import weft.moe.experts as experts_module

    torch.manual_seed(0)
    experts = Experts(DIM, HIDDEN, LOCAL, activation=activation, dtype=torch.float64)
    params = list(experts.parameters())
    calls = [([4, 0, 5], 6), ([0, 3, 1], 2), ([2, 2, 2], 0)]
    xs = [torch.randn(sum(c) + pad, DIM, dtype=torch.float64, requires_grad=True) for c, pad in calls]
    dys = [torch.randn(x.shape, dtype=torch.float64) for x in xs]
    ends = [torch.tensor(c).cumsum(0).to(torch.int32) for c, _ in calls]
    want_y = [experts.forward_offsets(x, e) for x, e in zip(xs, ends)]
    want = torch.autograd.grad(want_y, [*xs, *params], dys)
    products, real = [], experts_module.grouped_weights_mm

    def counted(x_MK, dy_MN, offs_G):
        products.append(offs_G.clone())
        return real(x_MK, dy_MN, offs_G)

    monkeypatch.setattr(experts_module, "grouped_weights_mm", counted)
    parts = experts_module.GroupedWeightGradParts(experts, len(calls), torch.float64)
    weights = parts.tapped()
    got_y = [experts.forward_offsets_part(x, e, parts, weights) for x, e in zip(xs, ends)]
    got = torch.autograd.grad(got_y, [*xs, *params], dys)
    for (counts, _), y, w in zip(calls, got_y, want_y):
        assert torch.allclose(y[:sum(counts)], w[:sum(counts)], rtol=1e-12, atol=1e-12)
    for i, (g, w) in enumerate(zip(got, want)):
        rows = sum(calls[i][0]) if i < len(calls) else None
        assert torch.allclose(g[:rows], w[:rows], rtol=1e-10, atol=1e-10), i
    total = [sum(c[e] for c, _ in calls) for e in range(LOCAL)]
    assert len(products) == len(params)  # one product per weight, over every call's rows
    assert all(p.tolist() == torch.tensor(total).cumsum(0).tolist() for p in products)


def test_leave_sms_sets_the_matmul_sm_carveout_inside_and_restores_it_after():
    """`leave_sms(n)`: PyTorch's SM carveout is n inside (nested: the inner value), back to what it
    was on exit, an exception included; 0 changes nothing."""
    from weft.kernels.grouped_mm import leave_sms

    before = torch._C._get_sm_carveout_experimental()
    backend = torch.backends.cuda.preferred_blas_library()
    with leave_sms(0):
        assert torch._C._get_sm_carveout_experimental() == before
    with leave_sms(16):
        assert torch._C._get_sm_carveout_experimental() == 16
        if not torch.cuda.is_available():  # cuBLASLt for cuBLAS's matmuls: CUDA only (test_gpu.py)
            assert torch.backends.cuda.preferred_blas_library() == backend
        with leave_sms(8):
            assert torch._C._get_sm_carveout_experimental() == 8
        assert torch._C._get_sm_carveout_experimental() == 16
    assert torch._C._get_sm_carveout_experimental() == before
    with pytest.raises(RuntimeError, match="inside"):
        with leave_sms(4):
            raise RuntimeError("inside")
    assert torch._C._get_sm_carveout_experimental() == before
    assert torch.backends.cuda.preferred_blas_library() == backend


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_float32_weights_under_autocast_are_cast_once_with_the_per_slice_results(activation):
    """float32 expert weights under bf16 autocast (`--master-weights off`, tensor parallelism): each
    stack is cast once (`in_dtype`) instead of each expert's slice in its own matmul, and unbound
    once where the experts run one by one (the CPU's reference; on GPUs one grouped GEMM takes the
    stack). The same bf16 values go into the same matmuls, so the outputs and float32 gradients
    equal the per-slice computation bitwise; and the backward no longer writes a zero gradient of
    the whole stack for every expert (2 x E weight-sized passes per stack, ~22 ms of a qwen2-moe-2l
    step on H100s)."""
    from torch.profiler import ProfilerActivity, profile


    def per_slice(xi: torch.Tensor) -> torch.Tensor:  # each expert's weight sliced (and cast) in its matmul
        outs = []
        for i, rows in enumerate(torch.split(xi, COUNTS)):
            h3 = rows @ experts.w3[i] if experts.w3 is not None else None
            outs.append(experts._hidden(rows @ experts.w1[i], h3) @ experts.w2[i])
        return torch.cat(outs)

    torch.manual_seed(0)
    experts = Experts(DIM, HIDDEN, LOCAL, activation=activation, dtype=torch.float32)
    params = list(experts.parameters())
    x = torch.randn(sum(COUNTS), DIM)
    dy = torch.randn(sum(COUNTS), DIM)

    def run(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            xi = x.clone().requires_grad_()
            y = forward(xi.to(torch.bfloat16))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            grads = torch.autograd.grad(y, [xi, *params], dy.to(y.dtype))
        stacks = {tuple(p.shape) for p in params}
        zeroed = sum(e.name in ("aten::zero_", "aten::fill_") and bool(e.input_shapes)
                     and tuple(e.input_shapes[0]) in stacks for e in prof.events())
        return y, grads, zeroed

    y, grads, zeroed = run(lambda xi: experts.forward_grouped(xi, COUNTS))
    want_y, want, per_slice_zeroed = run(per_slice)
    assert torch.equal(y, want_y)
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(grads, want))
    assert all(g.dtype == torch.float32 for g in grads[1:])
    assert per_slice_zeroed >= LOCAL and zeroed == 0, (zeroed, per_slice_zeroed)
