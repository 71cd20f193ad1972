"""AWQ (qtool.calibration.awq): the folded model computes the same function before quantization
(plain, Gemma's 1 + w and Phi-3's fused norms and Linears); the search's grid and scale formula
are llm-compressor's; on a tiny model whose activations have outlier channels AWQ's layer output
error is well below round to nearest's; end to end on each tiny family, the output loads in
transformers, decodes as qtool does, and carries the smoothed norms."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qtool import api  # noqa: E402
from qtool.calibration import awq  # noqa: E402
from tests.test_calibration_runner import FAMILIES, LINEARS_PER_LAYER, text_file, tiny_model  # noqa: E402

SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
CONFIGS = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 4}),  # no GQA: the v_proj -> o_proj mapping applies
    "llama-gqa": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 4}),  # q/k/v biases: v_proj's is divided too
    "gemma2": ("Gemma2Config", {"num_key_value_heads": 4}),  # norms compute x (1 + w)
    "gemma3": ("Gemma3TextConfig", {"num_key_value_heads": 4}),
    "phi3": (
        "Phi3Config",
        {"num_key_value_heads": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),  # fused qkv_proj and gate_up_proj
}


def tiny(family: str):
    name, extra = CONFIGS[family]
    config = getattr(transformers, name)(**{**SMALL, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms away from their init, so folding into them is seen
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", list(CONFIGS))
def test_folding_random_scales_leaves_the_float_function_unchanged(family):
    model = tiny(family)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    generator = torch.Generator().manual_seed(1)
    seen = []
    for layer in model.model.layers:
        mappings = awq.layer_mappings(layer, model.config.model_type, lambda name: True)
        seen.append([m.smooth for m in mappings])
        modules = dict(layer.named_modules())
        for mapping in mappings:
            balance = [modules[name] for name in mapping.balance]
            scales = torch.rand(balance[0].in_features, generator=generator) * 4 + 0.25
            awq.fold(modules[mapping.smooth], balance, scales)
    with torch.no_grad():
        after = model(input_ids=tokens).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    expected = {
        "llama": ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"],
        "llama-gqa": ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"],
        "qwen2": ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"],
        "gemma2": ["input_layernorm", "self_attn.v_proj", "pre_feedforward_layernorm", "mlp.up_proj"],
        "gemma3": ["self_attn.v_proj", "pre_feedforward_layernorm", "mlp.up_proj"],
        "phi3": ["input_layernorm", "self_attn.qkv_proj", "post_attention_layernorm", "mlp.gate_up_proj"],
    }[family]
    assert seen == [expected, expected]


def test_folding_changes_the_function_when_the_balance_side_is_left_out():
    """The test above can fail: dividing the norm alone changes the logits."""
    model = tiny("llama")
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        before = model(input_ids=tokens).logits
        model.model.layers[0].input_layernorm.weight.data /= torch.linspace(0.5, 2, 64)
        after = model(input_ids=tokens).logits
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)


def test_the_grid_and_the_scale_formula_are_llm_compressors():
    points = awq.grid()
    assert len(points) == 20 and points[0] == (0.0, False)
    assert [r for r, duo in points[1:]] == [i / 18 for i in range(19)] and all(duo for _, duo in points[1:])
    x = torch.tensor([1.0, 4.0, 9.0, 0.0])
    w = torch.tensor([0.5, 0.25, 1.0, 0.5])
    s = awq.candidate_scales(x, w, 0.5, True)
    raw = (x.sqrt() / (w.sqrt() + 1e-4)).clamp(min=1e-4)
    torch.testing.assert_close(s, raw / (raw.max() * raw.min()).sqrt())
    assert torch.equal(awq.candidate_scales(x, w, 0.0, False), torch.ones(4))


def test_weight_means_normalize_by_each_groups_max():
    w = torch.tensor([[1.0, -2.0, 3.0, -6.0], [4.0, 0.0, 1.0, 1.0]])
    means = awq.weight_means([w], [2])
    expected = torch.tensor([[0.5, 1.0, 0.5, 1.0], [1.0, 0.0, 1.0, 1.0]]).mean(dim=0)
    torch.testing.assert_close(means, expected, rtol=1e-5, atol=1e-5)


def test_rtn_is_compressed_tensors_round_to_nearest():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(3)
    weight = torch.randn(8, 64)
    for symmetric in (True, False):
        ours = awq.rtn(weight, bits=4, group_size=32, symmetric=symmetric, scale_dtype=torch.float32)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32)
        grouped = weight.reshape(8, 2, 32)
        scale, zero = calculate_qparams(grouped.amin(dim=2), grouped.amax(dim=2), args)
        theirs = fake_quantize(weight, scale, zero, args)
        torch.testing.assert_close(ours.dequantized(), theirs, rtol=0, atol=1e-6)


def _outlier_model(folder):
    """tiny-llama's family with a few input channels of each layer 20x larger: what AWQ is for."""
    tiny_model(folder, "llama", dtype=torch.float32)
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in list(tensors):
        if name.endswith("input_layernorm.weight") or name.endswith("post_attention_layernorm.weight"):
            tensors[name] = tensors[name].clone()
            tensors[name][:4] *= 20
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def _layer_errors(model, text, algorithm, tmp_path):
    from qtool.calibration.runner import RunnerOptions, calibrate

    plan = api.prepare_quantize(model, tmp_path / f"out-{algorithm}", "int3:g32", calibrate=text, samples=4, seq_len=32)
    try:
        result = calibrate(
            plan.source, [j.weight for j in plan.jobs], {j.weight.name: j.scheme for j in plan.jobs if j.scheme is not None},
            plan.layout, plan.calibration.tokens, RunnerOptions(algorithm=algorithm),
        )  # fmt: skip
    finally:
        plan.source.close()
    return [layer.output_error for layer in result.layers], result


def test_awq_has_a_smaller_layer_output_error_than_round_to_nearest(tmp_path):
    model = _outlier_model(tmp_path / "model")
    text = text_file(tmp_path)
    rtn, _ = _layer_errors(model, text, "rtn", tmp_path)
    smoothed, result = _layer_errors(model, text, "awq", tmp_path)
    assert smoothed[0] < 0.8 * rtn[0], (smoothed, rtn)
    assert sum(smoothed) < sum(rtn), (smoothed, rtn)
    assert {"model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"} <= set(
        result.replaced
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_awq_end_to_end_loads_in_transformers_and_decodes_as_qtool_does(tmp_path, family):
    from safetensors.torch import load_file

    model = tiny_model(tmp_path / family, family)
    out, plain = tmp_path / "out", tmp_path / "plain"
    plan = api.prepare_quantize(
        model, out, "int4:g32:asym", calibrate=text_file(tmp_path), algorithm="awq", samples=4, seq_len=32
    )
    document = api.run(plan).to_json()
    assert document["calibration"]["algorithm"] == "awq"
    assert [layer["layer"] for layer in document["calibration"]["layers"]] == [0, 1]
    api.dequantize(out, plain)
    ours = load_file(str(plain / "model.safetensors"))
    original = load_file(str(model / "model.safetensors"))
    norms = [name for name in original if name.startswith("model.layers.") and name.endswith("norm.weight")]
    assert all(ours[name].dtype == original[name].dtype for name in norms)
    assert any(not torch.equal(ours[name], original[name]) for name in norms)  # smoothed (a search may keep s = 1)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    linears = {n: m for n, m in loaded.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert len(linears) == 2 * LINEARS_PER_LAYER.get(family, 7)
    for name, module in linears.items():
        assert torch.equal(module.weight.detach(), ours[name + ".weight"]), name
    for name in norms:
        assert torch.equal(loaded.get_submodule(name.rpartition(".")[0]).weight.detach(), ours[name]), name
    assert loaded.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


@pytest.mark.parametrize("bias", [False, True])
def test_the_search_on_a_lone_linear_from_xtx_is_the_search_from_its_outputs(bias):
    """o_proj / down_proj: the grid's errors from X^T X equal those of running the Linear on the
    inputs (to float rounding), so the same scales win."""
    import functools

    from qtool.calibration.codes import rtn_values as _rtn_values
    from qtool.calibration.gram import mirror as _mirror
    from qtool.calibration.gram import upper_gram as _upper_gram

    generator = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(128, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=generator))
    channel = torch.rand(128, generator=generator) * 4 + torch.where(
        torch.rand(128, generator=generator) < 0.05, 20.0, 0.0
    )
    samples = [torch.randn(1, 40, 128, generator=generator) * channel for _ in range(3)]
    hessian, scratch = torch.zeros(128, 128), torch.zeros(128, 128)
    for x in samples:
        hessian.add_(_upper_gram(x.reshape(-1, 128), scratch))
    _mirror(hessian)
    x_mean = torch.cat([x.reshape(-1, 128) for x in samples]).abs().mean(dim=0)
    quantize = functools.partial(_rtn_values, bits=3, group_size=32, symmetric=True, scale_dtype=torch.float32)
    forward = awq.search(linear, [((x,), {}) for x in samples], [linear], [quantize], x_mean, [32])
    shortcut = awq.search(linear, [], [linear], [quantize], x_mean, [32], gram=(hessian, 120))
    assert (shortcut.ratio, shortcut.duo) == (forward.ratio, forward.duo)
    assert torch.equal(shortcut.scales, forward.scales)
    assert shortcut.error == pytest.approx(forward.error, rel=1e-4)
    assert shortcut.identity_error == pytest.approx(forward.identity_error, rel=1e-4)
    assert forward.error < 0.95 * forward.identity_error  # the grid found something: not a test of s = 1 alone


@pytest.mark.parametrize("path", ["forwards", "xtx"])
def test_a_grid_with_no_finite_error_is_a_kernel_error_not_a_read_before_assignment(path):
    """Issue 37 (ruff's one real finding): the search's pick of the best grid point read
    `errors_best` behind a short-circuit, bound only once a point had won. Inputs that make
    every point's error NaN (inf after the NaN guard, so no point is ever better) reach the
    end of the pick with the first point taken at inf: a one-line KernelError, from the
    racing forwards' errors and from X^T X's alike."""
    import functools

    from qtool.calibration.codes import rtn_values
    from qtool.errors import KernelError

    linear = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(5)))
    x = torch.full((1, 8, 64), float("nan"))
    quantize = functools.partial(rtn_values, bits=4, group_size=32, symmetric=True, scale_dtype=torch.float32)
    x_mean = torch.ones(64)
    with pytest.raises(KernelError, match="no finite output error"):
        if path == "forwards":
            awq.search(linear, [((x,), {})], [linear], [quantize], x_mean, [32])
        else:
            awq.search(linear, [], [linear], [quantize], x_mean, [32], gram=(torch.full((64, 64), float("nan")), 8))


def test_the_float_outputs_caught_in_the_layers_run_are_the_ones_the_search_would_compute(tmp_path, monkeypatch):
    """The runner hands each search its parent's float outputs from the layer's own run; a search
    that runs the parent itself first gets the same numbers, so every code is the same."""
    model = _outlier_model(tmp_path / "model")
    text = text_file(tmp_path)
    _, given = _layer_errors(model, text, "awq", tmp_path)
    search, handed = awq.search, []

    def computing(*args, reference=None, **kwargs):
        handed.append(reference is not None)
        if reference is not None:
            parent, inputs = args[0], args[1]
            with torch.no_grad():
                recomputed = [parent(*a, **k) for a, k in inputs]
            recomputed = [r[0] if isinstance(r, tuple) else r for r in recomputed]
            assert all(torch.equal(r, c) for r, c in zip(reference, recomputed))
        return search(*args, **kwargs)

    monkeypatch.setattr(awq, "search", computing)
    _, computed = _layer_errors(model, text, "awq", tmp_path)
    assert any(handed)
    assert given.encoded.keys() == computed.encoded.keys()
    for name, tensors in given.encoded.items():
        assert all(torch.equal(tensors[key], computed.encoded[name][key]) for key in tensors), name


def test_awq_feeds_each_layer_the_float_models_activations(tmp_path, monkeypatch):
    """AWQ as AutoAWQ and llm-compressor run it: the smoothing keeps the float function, so the
    next layer is fed the float layer's outputs, and each layer's scales are searched on the
    float model's activations: layer 1's inputs are the float model's (transformers' own), far
    from those of the model as written (a coarse scheme: a clear difference)."""
    from qtool.calibration import awq_step
    from tests.test_calibration_runner import TINY, calibrate_plan, relative

    def layer_1_inputs(folder, tokens):
        """X^T X of what transformers' own float32 model gives layer 1."""
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        total = []
        hook = model.model.layers[1].register_forward_pre_hook(
            lambda module, args: total.append(args[0].reshape(-1, args[0].shape[-1]).double())
        )
        with torch.no_grad():
            for row in tokens:
                model(row.unsqueeze(0))
        hook.remove()
        x = torch.cat(total)
        return x.T @ x

    seen = {}
    real = awq_step._awq_layer

    def catching(model_type, layer, prefix, *args, **kwargs):
        hidden = args[3]
        if prefix.endswith(".1"):
            x = hidden.reshape(-1, hidden.shape[-1]).double()
            seen["gram"] = x.T @ x
        return real(model_type, layer, prefix, *args, **kwargs)

    monkeypatch.setattr(awq_step, "_awq_layer", catching)
    plan = calibrate_plan(TINY, tmp_path / "out", text_file(tmp_path), scheme="int2:g32", algorithm="awq")
    tokens = plan.calibration.tokens
    api.run(plan)
    api.dequantize(tmp_path / "out", tmp_path / "plain", dtype="f32")
    assert relative(seen["gram"], layer_1_inputs(TINY, tokens)) < 1e-4
    assert relative(seen["gram"], layer_1_inputs(tmp_path / "plain", tokens)) > 1e-2


def direct_clip(weight, inputs, quantize, group):
    """llm-awq's auto_clip written out in float64 for every (row, group): each ratio on the grid
    clamps the group, the group's share of the output (its columns' products with the inputs) is
    compared with the unclipped one, and the ratio of least squared error wins (the first of equals)."""
    rows, cols = weight.shape
    best = torch.empty(rows, cols // group, dtype=torch.float64)
    candidates = []
    peak = weight.reshape(rows, -1, group).abs().amax(dim=2, keepdim=True)
    for step in range(int(awq.CLIP_MAX_SHRINK * awq.CLIP_GRID)):
        limit = peak * (1 - step / awq.CLIP_GRID)
        candidates.append(
            (limit, quantize(torch.clamp(weight.reshape(rows, -1, group), -limit, limit).reshape(rows, cols)))
        )
    for r in range(rows):
        for g in range(cols // group):
            columns = slice(g * group, (g + 1) * group)
            reference = inputs[:, columns].double() @ weight[r, columns].double()
            errors = [
                float((inputs[:, columns].double() @ q[r, columns].double() - reference).pow(2).sum())
                for _, q in candidates
            ]
            best[r, g] = candidates[errors.index(min(errors))][0][r, g, 0]
    return torch.clamp(weight.reshape(rows, -1, group).double(), -best.unsqueeze(2), best.unsqueeze(2)).reshape(
        rows, cols
    )


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_clipping_picks_each_groups_ratio_of_least_output_error(symmetric):
    import functools

    from qtool.calibration.codes import rtn_values as _rtn_values

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 96, dtype=torch.float64, generator=generator)
    weight[torch.rand(16, 96, generator=generator) < 0.03] *= 6  # outliers: clipping them pays
    inputs = torch.randn(400, 96, dtype=torch.float64, generator=generator) @ torch.randn(
        96, 96, dtype=torch.float64, generator=generator
    )
    quantize = functools.partial(_rtn_values, bits=3, group_size=32, symmetric=symmetric, scale_dtype=torch.float64)
    clipped = awq.clip(weight, inputs.T @ inputs, quantize, 32)
    expected = direct_clip(weight, inputs, quantize, 32)
    assert torch.equal(clipped, expected)
    assert not torch.equal(clipped, weight), "no group was clipped: the test compares nothing"
    errors = lambda w: ((quantize(w) - weight) @ inputs.T).pow(2).sum()  # noqa: E731
    assert errors(clipped) < 0.95 * errors(weight)


def test_clipping_takes_every_linear_but_the_queries_and_keys():
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.qkv_proj", "model.layers.3.self_attn.k_proj.weight"]
    assert not any(awq.clipped(name) for name in names)
    assert all(
        awq.clipped(name)
        for name in [
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_up_proj",
            "mlp.down_proj",
            "block_sparse_moe.experts.0.w2",
        ]
    )


def test_a_bad_hessian_for_clipping_is_a_kernel_error():
    from qtool.errors import KernelError

    with pytest.raises(KernelError, match="needs a hessian"):
        awq.clip(torch.zeros(4, 64), torch.zeros(32, 32), lambda w: w, 32)


def test_awq_clips_all_but_the_queries_and_keys_on_the_inputs_they_see_once_smoothed(tmp_path, monkeypatch):
    """Each layer's v, o, gate, up and down weights go through the clipping search (q and k do
    not), each with X^T X of its inputs as the smoothed layer feeds them: for layer 0's v_proj,
    the smoothed input_layernorm's outputs (x / s), which the float model with that norm gives."""
    model = _outlier_model(tmp_path / "model")
    text = text_file(tmp_path)
    handed, real = [], awq.clip

    def recording(weight, hessian, quantize, group):
        handed.append((tuple(weight.shape), hessian.clone()))
        return real(weight, hessian, quantize, group)

    monkeypatch.setattr(awq, "clip", recording)
    _, result = _layer_errors(model, text, "awq", tmp_path)
    v, o, gate, up, down = (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)
    assert sorted(shape for shape, _ in handed) == sorted([v, o, gate, up, down] * 2)
    plan = api.prepare_quantize(model, tmp_path / "again", "int3:g32", calibrate=text, samples=4, seq_len=32)
    tokens = plan.calibration.tokens
    plan.source.close()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    norm = loaded.model.layers[0].input_layernorm
    smoothed = result.replaced["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(smoothed, norm.weight.detach())
    with torch.no_grad():
        norm.weight.copy_(smoothed)
    seen = []
    hook = loaded.model.layers[0].self_attn.v_proj.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].reshape(-1, 64).double())
    )
    with torch.no_grad():
        for row in tokens:
            loaded(torch.as_tensor(row).unsqueeze(0))
    hook.remove()
    x = torch.cat(seen)
    expected = x.T @ x
    first_v = next(hessian for shape, hessian in handed if shape == v)
    torch.testing.assert_close(first_v.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_the_raced_grid_sums_its_finalists_in_full_and_runs_far_fewer_forwards():
    """Every point on the first eighth of the samples; point 0 and the best `RACE_FINALISTS`
    there on all of them, each finalist's error exactly the whole grid's; the rest never
    finish. Here the race's winner is the whole grid's, at well under half the forwards."""
    import functools

    from qtool.calibration.codes import rtn_values as _rtn_values

    generator = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(128, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=generator))
    channel = torch.rand(128, generator=generator) * 4 + torch.where(
        torch.rand(128, generator=generator) < 0.05, 20.0, 0.0
    )
    samples = [((torch.randn(1, 40, 128, generator=generator) * channel,), {}) for _ in range(32)]
    quantize = functools.partial(_rtn_values, bits=3, group_size=32, symmetric=True, scale_dtype=torch.float32)
    x_mean = torch.cat([args[0].reshape(-1, 128) for args, _ in samples]).abs().mean(dim=0)
    candidates = [
        awq.candidate_scales(x_mean, awq.weight_means([linear.weight.data], [32]), ratio, duo)
        for ratio, duo in awq.grid()
    ]
    original = linear.weight.data
    reference = [linear(*args) for args, _ in samples]

    def set_weights(scales):
        linear.weight.data = quantize(original * scales.unsqueeze(0)) / scales.unsqueeze(0)

    whole = []
    for scales in candidates:
        set_weights(scales)
        whole.append(
            sum(float((linear(*args).double() - r.double()).pow(2).sum()) for (args, _), r in zip(samples, reference))
            / sum(r.numel() for r in reference)
        )
    forwards = []
    hook = linear.register_forward_pre_hook(lambda module, args: forwards.append(1))
    raced = awq._raced_errors(linear, samples, reference, set_weights, candidates)
    hook.remove()
    linear.weight.data = original
    finished = [point for point, error in enumerate(raced) if error is not None]
    assert 0 in finished and len(finished) <= 1 + awq.RACE_FINALISTS
    for point in finished:
        assert raced[point] == pytest.approx(whole[point], rel=1e-12)
    assert min(finished, key=lambda point: raced[point]) == min(range(len(whole)), key=whole.__getitem__)
    assert len(forwards) <= 0.45 * len(candidates) * len(samples)
