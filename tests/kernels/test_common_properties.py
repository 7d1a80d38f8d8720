"""The host-side functions of kernels.common against their definitions, on fresh sizes: tile sizes and grid extents,
padding of the time axis, the row views and token strides a kernel addresses, the layout check, and the dtypes
an autocast region hands to linear layers and to the recurrent families."""
from __future__ import annotations

import pytest
import torch

from kernels import common


def _sizes(count=20, high=300):
    return [int(v) for v in torch.randint(0, high, (count,))]


def test_pow2_is_the_smallest_power_of_two_at_or_above_n_and_lo():
    for n, lo in zip(_sizes(), _sizes(high=70)):
        want = 1
        while want < max(n, lo):
            want *= 2
        assert common.pow2(n, lo) == want, (n, lo)
    for k in range(12):
        assert common.pow2(2 ** k) == 2 ** k and common.pow2(2 ** k + 1) == 2 ** (k + 1)


def test_cdiv_is_the_ceiling_of_the_quotient():
    for a, b in zip(_sizes(), _sizes(high=40)):
        b += 1
        assert common.cdiv(a, b) == len(range(0, a, b)), (a, b)
    b = int(torch.randint(1, 50, ()))
    assert common.cdiv(0, b) == 0 and common.cdiv(3 * b, b) == 3 and common.cdiv(3 * b + 1, b) == 4


def test_pad_time_pads_to_the_next_multiple_and_never_a_whole_extra_one():
    multiple = int(torch.randint(1, 9, ()))
    for T in range(0, 3 * multiple + 1):
        x = torch.randn(2, T, 3)
        value = float(torch.randn(()))
        y = common.pad_time(x, multiple, value)
        assert y.shape[1] % multiple == 0 and T <= y.shape[1] < T + multiple, (T, multiple)
        assert torch.equal(y[:, :T], x) and (y[:, T:] == value).all()


def _token_view(B, T, H, n, how):
    """(B, T, H, n) views of known layouts."""
    if how == "contiguous":
        return torch.randn(B, T, H, n), True
    if how == "columns":       # the value columns of a wider fused projection: tokens 3 H n apart
        return torch.randn(B, T, 3 * H * n)[..., H * n:2 * H * n].view(B, T, H, n), True
    if how == "batches apart":  # batches further apart than T tokens: rows are not (b T + t) stride
        return torch.randn(B, T + 1, H * n)[:, :T].view(B, T, H, n), B == 1
    if how == "heads first":    # (B, H, T, n) seen as (B, T, H, n)
        return torch.randn(B, H, T, n).transpose(1, 2), H == 1 or T == 1
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["contiguous", "columns", "batches apart", "heads first"])
def test_token_stride_addresses_every_element_as_rows_of_tokens(how):
    B, T, H, n = (int(v) for v in torch.randint(2, 5, (4,)))
    x, addressable = _token_view(B, T, H, n, how)
    stride = common.token_stride(x)
    assert (stride is not None) == addressable
    if stride is None:
        return
    flat = x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)
    for b in range(B):
        for t in range(T):
            row = x.storage_offset() + (b * T + t) * stride
            assert torch.equal(flat[row:row + H * n], x[b, t].reshape(-1)), (b, t)


@pytest.mark.parametrize("how", ["contiguous", "strided last", "columns", "transposed"])
def test_as_rows_is_the_same_values_with_unit_column_stride(how):
    R, D = int(torch.randint(2, 6, ())), int(torch.randint(2, 6, ()))
    base = torch.randn(2, R, 3 * D)
    t = {"contiguous": base[..., :D].contiguous(), "strided last": base[..., ::3], "columns": base[..., D:2 * D],
         "transposed": base[..., :D].transpose(0, 1)}[how]
    rows = common.as_rows(t)
    assert rows.shape == (t.numel() // D, D) and rows.stride(-1) == 1
    assert torch.equal(rows, t.reshape(-1, D))
    last = common.unit_last(t)
    assert last.stride(-1) == 1 and torch.equal(last, t)


def test_check_layout_refuses_a_size_that_disagrees_and_names_it():
    B, T, H = (int(v) for v in torch.randint(1, 5, (3,)))
    q, g = torch.randn(B, T, H, 4), torch.randn(B, T, H)
    assert common.check_layout("op", q=(q, "B T H K"), g=(g, "B T H"), none=(None, "B T")) == \
        {"B": B, "T": T, "H": H, "K": 4}
    with pytest.raises(ValueError, match=rf"op: g of shape \({B}, {T + 1}, {H}\) .* with T = {T}"):
        common.check_layout("op", q=(q, "B T H K"), g=(torch.randn(B, T + 1, H), "B T H"))
    with pytest.raises(ValueError, match="op: g must be"):
        common.check_layout("op", q=(q, "B T H K"), g=(q, "B T H"))


def test_linear_input_dtype_follows_autocast_only_for_floating_tensors():
    x, ids = torch.randn(3), torch.arange(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert common.linear_input_dtype(x) == torch.bfloat16
        assert common.linear_input_dtype(ids) == torch.int64
    assert common.linear_input_dtype(x) == torch.float32


def test_full_precision_switches_cpu_autocast_off_inside():
    @common.full_precision
    def product(a, b):
        return a @ b
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
        out = product(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (a.double() @ b.double()).float())
