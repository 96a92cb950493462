"""The Triton row kernels of dispatch and combine (weft.kernels.rows) against their PyTorch
references, run in Triton's CPU interpreter (in ranks whose kernels were defined under
TRITON_INTERPRET=1: `weft.testing.run_distributed`), and the fused dispatch/combine against the index-op path, also
written into given buffers (`dispatch_rows(..., into_RD)`, `combine_rows(..., grad_into_RD)`) and
with the combine's own copy of the rows it reads (`keep_rows`)."""
from __future__ import annotations

import itertools

import pytest
import torch

from weft.testing import run_distributed

pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")


def kernels_worker(device: str = "cpu") -> list[str]:
    from weft.kernels import rows as R
    from weft.moe.dispatch import SlotRows, combine, combine_rows, dispatch_padded, dispatch_rows

    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)

    gen = torch.Generator().manual_seed(0)
    # Each kernel at its default tile and at tiles of fewer rows and columns: 700 columns are two
    # blocks of 512 (the second partial), three of 256, six of 128; 7 or 8 rows, partial row tiles.
    tiles = (None, (1, 512), (4, 256), (2, 128))
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(10, 700, generator=gen).to(device, dtype)
        src[3] = float("inf")  # row 3 is never referenced: it must not leak into any output
        index = torch.tensor([2, -1, 5, 1, 9, -1, 4, 19], device=device)
        scale = torch.randn(20, generator=gen).to(device)  # indexed by the index values
        scale[0] = float("inf")  # no index names 0: the rows of index -1 are zeros, not 0 * scale[0]
        for (s, divisor), tile in itertools.product(((None, 1), (scale, 1), (None, 2), (scale, 2)), tiles):
            idx = index if divisor == 2 else index[:-1]  # 19 is a row of src only with divisor 2
            got = R.gather_rows(src, idx, s, divisor=divisor, tile=tile)
            want = R.gather_rows_reference(src, idx, s, divisor=divisor)
            # A plain copy is exact; a scaled bf16 row may round differently (the interpreter's cast).
            same = torch.equal(got, want) if s is None or dtype == torch.float32 else torch.allclose(
                got.float(), want.float(), rtol=2**-7, atol=0)
            expect(same, f"gather_rows {dtype} scale={s is not None} divisor={divisor} tile={tile}")
        rows = torch.tensor([[0, 5, -1], [-1, 2, 8], [7, 1, 4], [-1, -1, -1]], device=device)
        weights = torch.randn(4, 3, generator=gen).to(device)
        weights[0, 2] = float("nan")  # the weight of a dropped slot is never read
        for w, tile in itertools.product((None, weights), tiles):
            got = R.weighted_row_sum(src, rows, w, torch.float32, tile=tile)
            want = R.weighted_row_sum_reference(src, rows, w, torch.float32)
            expect(torch.allclose(got, want, rtol=1e-5, atol=1e-5),
                   f"weighted_row_sum {dtype} weights={w is not None} tile={tile}")
            expect(torch.equal(got[3], torch.zeros(700, device=device)), "a token with every slot dropped sums to zero")
            kept = torch.full_like(src, float("nan"))
            again = R.weighted_row_sum(src, rows, w, torch.float32, kept, tile=tile)
            expect(torch.equal(again, got), f"weighted_row_sum {dtype} keeping its rows sums otherwise")
            used = rows[rows >= 0].unique()
            expect(torch.equal(kept[used], src[used]), f"weighted_row_sum {dtype} kept rows differ from the read ones")
            unused = torch.ones(len(src), dtype=torch.bool, device=device)
            unused[used] = False
            expect(bool(kept[unused].isnan().all()), f"weighted_row_sum {dtype} wrote rows no index names")
        a = torch.randn(4, 700, generator=gen).to(device, dtype)
        a[3] = float("inf")  # token 3 has every slot dropped: its dots are 0 all the same
        for tile in tiles:
            got, want = R.row_dots(a, src, rows, tile=tile), R.row_dots_reference(a, src, rows)
            expect(torch.allclose(got, want, rtol=1e-4, atol=1e-3),
                   f"row_dots {dtype} tile={tile}: {(got - want).abs().max()}")
            expect(bool((got[rows < 0] == 0).all()), f"row_dots is 0 for dropped slots (tile={tile})")
    empty = torch.zeros(0, dtype=torch.long, device=device)
    expect(R.gather_rows(torch.randn(3, 8, device=device), empty).shape == (0, 8), "gather of no rows")
    expect(R.weighted_row_sum(torch.randn(3, 8, device=device), empty.view(0, 2)).shape == (0, 8), "sum for no tokens")

    # Fused dispatch + combine equal the index-op path, forward and backward, with drops.
    T, k, E, C, D = 6, 2, 4, 2, 16
    experts_S = torch.tensor([0, 1, 0, 2, 0, 1, 3, 0, 2, 3, 1, 1], device=device)
    positions_S = torch.tensor([0, 0, 1, 0, 2, 1, 0, 3, 1, 1, 2, 3], device=device)
    kept_S = positions_S < C
    token_ids_S = torch.arange(T, device=device).repeat_interleave(k)
    gates = torch.rand(T * k, generator=gen).to(device) * kept_S
    rows_S = experts_S * C + positions_S
    x = torch.randn(T, D, generator=gen).to(device)
    w = torch.randn(D, D, generator=gen).to(device)
    results = []
    # staged: the rows and their gradient written into rows of bigger buffers (as into Comet's peer
    # buffers), and the experts' outputs overwritten after the combine's forward (`transient_out`)
    rows_buffer, grads_buffer = (torch.full((E * C + 3, D), float("nan"), device=device) for _ in range(2))
    for fused, staged in ((False, False), (True, False), (True, True)):
        xi, gi = x.clone().requires_grad_(), gates.clone().requires_grad_()
        if fused:
            slot_rows = SlotRows.padded(rows_S, kept_S, E * C, k)
            into, grad_into = (rows_buffer[: E * C], grads_buffer[: E * C]) if staged else (None, None)
            dispatched = dispatch_rows(xi, slot_rows, into)
            expect(not staged or dispatched.data_ptr() == rows_buffer.data_ptr(), "dispatch_rows wrote elsewhere")
            out = dispatched @ w
            out.register_hook(lambda grad, staged=staged: expect(
                not staged or grad.data_ptr() == grads_buffer.data_ptr(), "combine_rows' gradient made elsewhere"))
            y = combine_rows(out, gi.view(T, k), slot_rows, torch.float32, grad_into, keep_rows=staged)
            if staged:  # as the next call's push overwrites them, unseen by autograd
                out.data.fill_(float("nan"))
        else:
            target = torch.where(kept_S, rows_S, E * C)
            out = dispatch_padded(xi, token_ids_S, target, E * C) @ w
            y = combine(out, target.clamp(max=E * C - 1), token_ids_S, gi, T, kept_S)
        y.backward(torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(device))
        results.append((y.detach(), xi.grad, gi.grad))
    for name, *values in zip(("output", "input grad", "gate grad"), *results):
        for label, got in zip(("fused", "fused and staged"), values[1:]):
            expect(torch.allclose(got, values[0], rtol=1e-5, atol=1e-5),
                   f"{label} {name} differs: {(got - values[0]).abs().max()}")
    expect(bool(rows_buffer[E * C:].isnan().all() and grads_buffer[E * C:].isnan().all()),
           "staged rows written past their slice")
    try:
        R.gather_rows(src, index[:-1], out=torch.empty(3, 700, device=device))
        expect(False, "gather_rows into an out of the wrong shape did not raise")
    except ValueError as e:
        expect("out must be" in str(e), f"gather_rows' error: {e}")
    try:
        R.weighted_row_sum(src, rows, None, None, torch.empty(10, 700, dtype=torch.float64, device=device))
        expect(False, "weighted_row_sum keeping into a tensor of another dtype did not raise")
    except ValueError as e:
        expect("kept_RD must be" in str(e), f"weighted_row_sum's error: {e}")
    for call in (lambda: R.gather_rows(src, index[:-1], tile=(3, 512)),
                 lambda: R.weighted_row_sum(src, rows, tile=(4, 0)),
                 lambda: R.row_dots(a, src, rows, tile=(4,))):
        try:
            call()
            expect(False, "a tile of other than two powers of two did not raise")
        except ValueError as e:
            expect("tile must be (BLOCK_R, BLOCK_D), two powers of two" in str(e), f"the tile's error: {e}")
    return failures


def test_row_kernels_match_their_references(triton_interpreter):
    failures = run_distributed(kernels_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)
