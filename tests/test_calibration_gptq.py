"""GPTQ's kernel against the paper's equations written out directly in float64: one column at a
time, the explicit inverse Hessian updated by Gaussian elimination (Frantar et al. 2022, eq. 2
and 3), no lazy batches, no Cholesky. Both must give the same codes and scales; and GPTQ must
beat round-to-nearest on the objective it minimises, ||(W - Q) X^T||^2."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qtool.calibration.gptq import gptq, observe, quantize_column  # noqa: E402


def paper_gptq(weight, inputs, bits, group, symmetric, dampening=0.01, observer="minmax", scale_dtype=torch.float64):
    """The OBQ/GPTQ update as the paper states it, in float64: quantize column q, then
    W[:, F] -= (w_q - quant(w_q)) / [H_F^-1]_qq * (H_F^-1)_{q,F}, and remove q from H_F^-1."""
    W = weight.double().clone()
    H = inputs.double().T @ inputs.double()
    cols = W.shape[1]
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += dampening * torch.mean(torch.diagonal(H)) * torch.eye(cols, dtype=torch.float64)
    H_inv = torch.linalg.inv(H)
    codes = torch.zeros(W.shape, dtype=torch.int8)
    scaled = torch.zeros(W.shape, dtype=torch.float64)
    scales, zero_points = [], []
    for q in range(cols):
        if q % group == 0:
            scale, zero_point = observe(W[:, q : q + group], bits, symmetric, scale_dtype, observer)
            scales.append(scale)
            zero_points.append(zero_point)
        code, value = quantize_column(W[:, q], scale, zero_point, bits)
        codes[:, q] = code
        scaled[:, q] = W[:, q] / scale.double() + (0 if zero_point is None else zero_point.double())
        error = (W[:, q] - value) / H_inv[q, q]
        W[:, q:] -= error.unsqueeze(1) * H_inv[q, q:].unsqueeze(0)
        H_inv = H_inv - H_inv[:, q : q + 1] @ H_inv[q : q + 1, :] / H_inv[q, q]  # eliminate q
    zp = None if symmetric else torch.stack(zero_points, dim=1)
    return codes, torch.stack(scales, dim=1), zp, scaled


def agreed_columns(actual, expected, scaled):
    """How many leading columns of each row must agree. The sweep (Cholesky of H^-1, lazy block
    updates) and the paper's explicit elimination differ in the last bits of float64, so a value
    on a rounding tie may round the other way, and that row's later columns then follow another,
    equally exact path (a row's error feeds only that row). Ties are common, not rare: a
    symmetric group whose absmax is a negative first column divides to exactly -2^(b-1) + 0.5.
    Any other difference fails: the first one in each row must sit on a tie."""
    agreed = []
    for row in range(actual.shape[0]):
        differ = (actual[row] != expected[row]).nonzero()
        if len(differ) == 0:
            agreed.append(actual.shape[1])
            continue
        first = int(differ[0])
        value = float(scaled[row, first])
        assert abs(abs(value - round(value)) - 0.5) < 1e-9, f"row {row}, column {first}: {value} is no tie"
        agreed.append(first)
    assert sum(agreed) >= actual.numel() // 2, "ties cut most rows short: the test compares little"
    return agreed


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([8, 16, 48]),
    symmetric=st.booleans(),
    block=st.sampled_from([16, 32, 128]),
)
def test_gptq_gives_the_papers_codes(seed, bits, group, symmetric, block):
    generator = torch.Generator().manual_seed(seed)
    rows, cols, samples = 6, 48, 80
    weight = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    inputs = (
        torch.randn(samples, cols, generator=generator, dtype=torch.float64)
        @ torch.randn(cols, cols, generator=generator, dtype=torch.float64)
        * 0.3
    )
    inputs[:, 5] = 0  # an input never seen: a dead column
    expected_codes, expected_scale, expected_zp, scaled = paper_gptq(weight, inputs, bits, group, symmetric)
    result = gptq(
        weight,
        inputs.T @ inputs,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        scale_dtype=torch.float64,
        block=block,
    )
    assert (result.zero_point is None) == symmetric
    for row, columns in enumerate(agreed_columns(result.codes, expected_codes, scaled)):
        groups = -(-(columns + 1) // group)  # every group observed up to the first difference
        torch.testing.assert_close(result.scale[row, :groups], expected_scale[row, :groups], rtol=1e-9, atol=0)
        if not symmetric:
            assert torch.equal(result.zero_point[row, :groups], expected_zp[row, :groups])


def paper_gptq_ordered(
    weight, inputs, bits, group, symmetric, dampening=0.01, observer="minmax", scale_dtype=torch.float64
):
    """The same elimination over the columns in decreasing order of H's diagonal, each with its
    own group's scale, observed first on the original weight (llm-compressor's actorder weight)."""
    W = weight.double().clone()
    H = inputs.double().T @ inputs.double()
    rows, cols = W.shape
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    scale, zero_point = observe(W.reshape(-1, group), bits, symmetric, scale_dtype, observer)
    scale = scale.reshape(rows, cols // group)
    zero_point = None if zero_point is None else zero_point.reshape(rows, cols // group)
    W, H = W[:, order], H[order][:, order]
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += dampening * torch.mean(torch.diagonal(H)) * torch.eye(cols, dtype=torch.float64)
    H_inv = torch.linalg.inv(H)
    codes = torch.zeros((rows, cols), dtype=torch.int8)
    for q in range(cols):
        g = int(order[q]) // group
        code, value = quantize_column(W[:, q], scale[:, g], None if zero_point is None else zero_point[:, g], bits)
        codes[:, int(order[q])] = code
        error = (W[:, q] - value) / H_inv[q, q]
        W[:, q:] -= error.unsqueeze(1) * H_inv[q, q:].unsqueeze(0)
        H_inv = H_inv - H_inv[:, q : q + 1] @ H_inv[q : q + 1, :] / H_inv[q, q]
    return codes, scale, zero_point


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([8, 16, 48]),
    symmetric=st.booleans(),
    block=st.sampled_from([16, 128]),
    actorder=st.sampled_from(["weight", "static"]),
)
def test_gptq_in_activation_order_gives_the_papers_codes_in_that_order(seed, bits, group, symmetric, block, actorder):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 48, generator=generator, dtype=torch.float64)
    inputs = (
        torch.randn(80, 48, generator=generator, dtype=torch.float64)
        * torch.linspace(0.1, 3, 48, dtype=torch.float64)[torch.randperm(48, generator=generator)]
    )
    inputs[:, 7] = 0
    expected_codes, expected_scale, expected_zp = paper_gptq_ordered(weight, inputs, bits, group, symmetric)
    result = gptq(
        weight,
        inputs.T @ inputs,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        scale_dtype=torch.float64,
        block=block,
        actorder=actorder,
    )
    assert torch.equal(result.codes, expected_codes)
    torch.testing.assert_close(result.scale, expected_scale, rtol=0, atol=0)
    assert (result.zero_point is None) if symmetric else torch.equal(result.zero_point, expected_zp)
    plain = gptq(
        weight,
        inputs.T @ inputs,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        scale_dtype=torch.float64,
        block=block,
    )
    assert bits == 8 or not torch.equal(plain.codes, result.codes)  # the order matters


@settings(max_examples=16, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([2, 3, 4]),
    group=st.sampled_from([16, 48]),
    symmetric=st.booleans(),
    actorder=st.sampled_from([None, "static"]),
)
def test_gptq_with_the_mse_observer_gives_the_papers_codes_with_its_scales(seed, bits, group, symmetric, actorder):
    """The mse observer (qtool.kernels.mse's search; float32 scales, which it stores) in place
    of min-max, when the sweep reaches a group or, in activation order, up front."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 48, generator=generator, dtype=torch.float64)
    inputs = (
        torch.randn(80, 48, generator=generator, dtype=torch.float64)
        @ torch.randn(48, 48, generator=generator, dtype=torch.float64)
        * 0.3
    )
    hessian = inputs.T @ inputs
    result = gptq(
        weight,
        hessian,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        scale_dtype=torch.float32,
        actorder=actorder,
        observer="mse",
    )
    minmax = gptq(
        weight, hessian, bits=bits, group_size=group, symmetric=symmetric, scale_dtype=torch.float32, actorder=actorder
    )
    assert not torch.equal(result.scale, minmax.scale)  # the search moved some scale
    if actorder is None:
        codes, scale, zero_point, scaled = paper_gptq(
            weight, inputs, bits, group, symmetric, observer="mse", scale_dtype=torch.float32
        )
        for row, columns in enumerate(agreed_columns(result.codes, codes, scaled)):
            groups = -(-(columns + 1) // group)
            assert torch.equal(result.scale[row, :groups], scale[row, :groups])
            assert symmetric or torch.equal(result.zero_point[row, :groups], zero_point[row, :groups])
    else:
        codes, scale, zero_point = paper_gptq_ordered(
            weight, inputs, bits, group, symmetric, observer="mse", scale_dtype=torch.float32
        )
        assert torch.equal(result.codes, codes) and torch.equal(result.scale, scale)
        assert (result.zero_point is None) if symmetric else torch.equal(result.zero_point, zero_point)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_the_mse_observer_never_reconstructs_a_row_worse_than_minmax(symmetric):
    generator = torch.Generator().manual_seed(1)
    columns = torch.randn(256, 32, generator=generator) * torch.rand(256, 1, generator=generator)
    errors = {}
    for observer in ("minmax", "mse"):
        scale, zero_point = observe(columns, 3, symmetric, torch.float32, observer)
        _, values = zip(*(quantize_column(columns[:, i], scale, zero_point, 3) for i in range(32)))
        errors[observer] = (columns - torch.stack(values, dim=1)).double().pow(2).sum(dim=1)
    assert bool((errors["mse"] <= errors["minmax"]).all())
    assert float(errors["mse"].sum()) < 0.95 * float(errors["minmax"].sum())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_the_mse_observer_searched_a_few_rows_at_a_time_gives_the_whole_search(symmetric, monkeypatch):
    from qtool.calibration import gptq as module
    from qtool.kernels.mse import choose_qparams_mse

    columns = torch.randn(100, 16, generator=torch.Generator().manual_seed(2))
    whole_scale, whole_zero = choose_qparams_mse(columns, (1, 16), "int3", symmetric, torch.float32)
    monkeypatch.setattr(module, "MSE_CHUNK", 16 * 7)  # 7 rows a call, the last call 2
    scale, zero_point = observe(columns, 3, symmetric, torch.float32, "mse")
    assert torch.equal(scale, whole_scale.reshape(-1))
    assert symmetric or torch.equal(zero_point, whole_zero.reshape(-1).to(torch.int8))


@pytest.mark.parametrize("observer", ["minmax", "mse"])
@pytest.mark.parametrize("actorder", [None, "static"], ids=["plain", "static"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_a_weight_with_no_rows_gives_empty_codes_not_a_crash(observer, actorder, symmetric):
    """issue 42 item 17: the mse observer joined its row chunks with torch.cat, and a weight with
    no rows (out_features 0) has none; activation order reshaped it with -1. Both: empty results."""
    from qtool.calibration.awq import rtn
    from qtool.kernels.mse import choose_qparams_mse

    weight = torch.zeros(0, 64)
    hessian = torch.eye(64)
    result = gptq(
        weight,
        hessian,
        bits=4,
        group_size=32,
        symmetric=symmetric,
        scale_dtype=torch.float16,
        actorder=actorder,
        observer=observer,
    )
    assert result.codes.shape == (0, 64) and result.scale.shape == (0, 2)
    assert symmetric or result.zero_point.shape == (0, 2)
    rounded = rtn(weight, bits=4, group_size=32, symmetric=symmetric, scale_dtype=torch.float16, observer=observer)
    assert rounded.codes.shape == (0, 64) and rounded.scale.shape == (0, 2)
    scale, zero_point = observe(weight.reshape(0, 32), 4, symmetric, torch.float32, observer)
    assert scale.shape == (0,) and (zero_point is None if symmetric else zero_point.shape == (0,))
    scale, _ = choose_qparams_mse(weight, (1, 32), "int4", symmetric, torch.float32)
    assert scale.shape == (0, 2)


@pytest.mark.parametrize("group", [32, None], ids=["g32", "channel"])
def test_gptq_beats_rounding_on_the_layer_output(group):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    inputs = torch.randn(512, 128, generator=generator) @ torch.randn(
        128, 128, generator=generator
    )  # correlated inputs
    result = gptq(weight, inputs.T @ inputs, bits=4, group_size=group, symmetric=True, scale_dtype=torch.float32)
    size = group or 128
    rtn = torch.cat([
        quantize_column_block(weight[:, start : start + size]) for start in range(0, 128, size)
    ], dim=1)  # fmt: skip
    gptq_error = ((weight - result.dequantized()) @ inputs.T).pow(2).sum()
    rtn_error = ((weight - rtn) @ inputs.T).pow(2).sum()
    assert gptq_error < 0.8 * rtn_error


def quantize_column_block(columns):
    scale, _ = observe(columns, 4, True, torch.float32)
    return (columns / scale.unsqueeze(1)).clamp(-8, 7).round() * scale.unsqueeze(1)


def test_scales_are_stored_in_the_weights_dtype_and_decode_exactly():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 64, generator=generator)
    inputs = torch.randn(100, 64, generator=generator)
    result = gptq(weight, inputs.T @ inputs, bits=4, group_size=32, symmetric=False, scale_dtype=torch.bfloat16)
    assert result.scale.dtype == torch.bfloat16 and result.zero_point.dtype == torch.int8
    assert int(result.codes.min()) >= -8 and int(result.codes.max()) <= 7


def test_bad_shapes_are_a_kernel_error():
    from qtool.errors import KernelError

    with pytest.raises(KernelError, match="group size 5 does not divide in_features 64"):
        gptq(torch.zeros(4, 64), torch.eye(64), bits=4, group_size=5, symmetric=True, scale_dtype=torch.float32)
    with pytest.raises(KernelError, match="hessian"):
        gptq(torch.zeros(4, 64), torch.eye(32), bits=4, group_size=None, symmetric=True, scale_dtype=torch.float32)


native = pytest.importorskip("qtool.native")


@pytest.mark.skipif(not native.available(), reason="qtool's C kernels are not built")
@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([16, 48, 64, None]),
    symmetric=st.booleans(),
    actorder=st.sampled_from([None, "static"]),
    rows=st.sampled_from([1, 5, 40]),
    threads=st.sampled_from([1, 3]),
)
def test_the_c_sweep_is_the_torch_sweep_bit_for_bit(seed, bits, group, symmetric, actorder, rows, threads):
    """float32 on the CPU goes through qtool.native's sweep; QTOOL_NATIVE=0 through the torch ops:
    the same codes, scales and zero points, whatever the split of rows over threads."""
    generator = torch.Generator().manual_seed(seed)
    cols = 192
    weight = torch.randn(rows, cols, generator=generator)
    inputs = (
        torch.randn(300, cols, generator=generator)
        @ torch.randn(cols, cols, generator=generator)
        * torch.rand(cols, generator=generator)
    )
    inputs[:, 3] = 0
    hessian = inputs.T @ inputs
    previous = native.threads()
    native.set_threads(threads)
    try:
        fast = gptq(
            weight,
            hessian,
            bits=bits,
            group_size=group,
            symmetric=symmetric,
            scale_dtype=torch.bfloat16,
            actorder=actorder,
        )
    finally:
        native.set_threads(previous)
    os.environ["QTOOL_NATIVE"] = "0"
    try:
        reference = gptq(
            weight,
            hessian,
            bits=bits,
            group_size=group,
            symmetric=symmetric,
            scale_dtype=torch.bfloat16,
            actorder=actorder,
        )
    finally:
        del os.environ["QTOOL_NATIVE"]
    assert torch.equal(fast.codes, reference.codes)
    assert torch.equal(fast.scale, reference.scale)
    assert (fast.zero_point is None) if symmetric else torch.equal(fast.zero_point, reference.zero_point)


def test_the_sweep_is_not_a_no_op_either_way(monkeypatch):
    """Both paths spread the error: their codes differ from rounding each column alone."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 128, generator=generator)
    inputs = torch.randn(400, 128, generator=generator) @ torch.randn(128, 128, generator=generator)
    for flag in ("1", "0"):
        monkeypatch.setenv("QTOOL_NATIVE", flag)
        result = gptq(weight, inputs.T @ inputs, bits=4, group_size=32, symmetric=True, scale_dtype=torch.float32)
        assert not torch.equal(
            result.dequantized(),
            torch.cat([quantize_column_block(weight[:, s : s + 32]) for s in range(0, 128, 32)], dim=1),
        )


@pytest.mark.parametrize("actorder", [None, "static"])
def test_a_shared_factor_gives_what_the_hessian_gives(actorder):
    from qtool.calibration.gptq import factor
    from qtool.errors import KernelError

    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(200, 64, generator=generator) * torch.rand(64, generator=generator)
    hessian = inputs.T @ inputs
    prepared = factor(hessian, dtype=torch.float32, actorder=actorder)
    for rows in (8, 24):
        weight = torch.randn(rows, 64, generator=generator)
        alone = gptq(
            weight, hessian, bits=4, group_size=16, symmetric=False, scale_dtype=torch.float32, actorder=actorder
        )
        shared = gptq(
            weight,
            None,
            bits=4,
            group_size=16,
            symmetric=False,
            scale_dtype=torch.float32,
            actorder=actorder,
            prepared=prepared,
        )
        assert torch.equal(alone.codes, shared.codes) and torch.equal(alone.scale, shared.scale)
    with pytest.raises(KernelError, match="does not fit"):
        gptq(
            torch.zeros(4, 64),
            None,
            bits=4,
            group_size=16,
            symmetric=True,
            scale_dtype=torch.float32,
            actorder="static" if actorder is None else None,
            prepared=prepared,
        )


@pytest.mark.parametrize("size", [1, 3, 64, 127, 200, 577])
def test_the_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(size):
    """U (upper, positive diagonal) with U^T U = (H + damp I)^-1, the factor llm-compressor
    takes by inverting and factoring again, here without forming the inverse."""
    from qtool.calibration.gptq import factor

    generator = torch.Generator().manual_seed(size)
    inputs = torch.randn(2 * size + 5, size, generator=generator, dtype=torch.float64) * torch.logspace(
        -3, 2, size, dtype=torch.float64
    )
    hessian = inputs.T @ inputs
    U = factor(hessian, dtype=torch.float64).U
    damped = hessian + 0.01 * hessian.diagonal().mean() * torch.eye(size, dtype=torch.float64)
    expected = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert torch.equal(U, torch.triu(U)) and bool((U.diagonal() > 0).all())
    torch.testing.assert_close(U, expected, rtol=1e-9, atol=1e-9 * float(expected.abs().max()))
    torch.testing.assert_close(U.T @ U @ damped, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-8)


@pytest.mark.parametrize("size", [1, 300, 384, 385, 577, 1000, 1537])
def test_the_cholesky_by_halves_is_torchs(size):
    """On both sides of the recursion's base, and odd sizes whose halves are not equal."""
    from qtool.calibration.gptq import _cholesky

    generator = torch.Generator().manual_seed(size)
    inputs = torch.randn(size + 50, size, generator=generator, dtype=torch.float64)
    hessian = inputs.T @ inputs + torch.eye(size, dtype=torch.float64)
    L = _cholesky(hessian)
    expected = torch.linalg.cholesky(hessian)
    assert torch.equal(L, torch.tril(L))
    torch.testing.assert_close(L, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))


def test_the_cholesky_by_halves_refuses_what_torch_refuses():
    from qtool.calibration.gptq import _cholesky

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(800, 800, generator=generator, dtype=torch.float64)
    indefinite = inputs.T @ inputs
    indefinite[700, 700] = -1.0  # a negative pivot in the second half's Schur complement
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(indefinite)
    with pytest.raises(torch.linalg.LinAlgError):
        _cholesky(indefinite)
