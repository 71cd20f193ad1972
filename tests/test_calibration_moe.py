"""Calibration of mixture-of-experts layers (Mixtral, Qwen3-MoE) on tiny random-weight models
that transformers builds from its own configs: transformers fuses each layer's experts in 3-D
weights, the checkpoints name one Linear per expert, and the runner unfuses them
(`qtool.calibration.experts`). Checked against transformers' own fused model: the unfused block
computes what the fused one does; each expert's Hessian is X^T X of exactly the tokens
transformers' router sends it; an expert no token reaches is rounded to nearest, not zeroed;
and the output loads in transformers with compressed-tensors, experts decompressed to what
`qtool dequantize` gives."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qtool import api  # noqa: E402
from tests.test_calibration_runner import TINY, calibrate_plan, in_one_run_only, text_file  # noqa: E402

FAMILIES = {"mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig"}
# (the block's name in the checkpoint, in transformers' model; the expert's gate, up, down)
NAMES = {
    "mixtral": ("block_sparse_moe", "mlp", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def tiny_moe(folder, family: str, *, experts: int = 4, top_k: int = 2, dtype=torch.bfloat16):
    """A 2-layer random-weight mixture of `experts` experts (top `top_k`), hidden 64, with
    tiny-llama's tokenizer, saved as transformers saves it (one Linear per expert)."""
    config = getattr(transformers, FAMILIES[family])(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=experts, num_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    return folder


def statistics_of_layer(plan, index: int, *, true_sequential: bool = False) -> dict:
    from qtool.calibration.runner import RunnerOptions, calibrate

    seen = {}
    try:
        calibrate(
            plan.source, [j.weight for j in plan.jobs], {j.weight.name: j.scheme for j in plan.jobs if j.scheme is not None},
            plan.layout, plan.calibration.tokens, RunnerOptions(true_sequential=true_sequential, actorder=plan.calibration.actorder),
            on_statistics=lambda at, name, hessian: seen.update({name: hessian.clone()}) if at == index else None,
        )  # fmt: skip
    finally:
        plan.source.close()
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_unfused_block_computes_what_transformers_fused_block_computes(tmp_path, family):
    from qtool.calibration.skeleton import Skeleton
    from qtool.formats import open_checkpoint
    from qtool.inspection import inspect_checkpoint

    model_folder = tiny_moe(tmp_path / family, family, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    stored, attribute, _ = NAMES[family]
    checkpoint = open_checkpoint(str(model_folder))
    try:
        skeleton = Skeleton.build(checkpoint)
        layer = skeleton.layers[0]
        weights = {w.name: w for w in inspect_checkpoint(checkpoint).weights}
        skeleton.materialize(layer, f"{skeleton.layers_prefix}.0", weights, checkpoint, "cpu")
    finally:
        checkpoint.close()
    assert stored in dict(layer.named_children()) and all(
        f"{stored}.experts.{e}" in dict(layer.named_modules()) for e in range(4)
    )
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = getattr(layer, attribute)(x)
        expected = getattr(theirs.model.layers[0], attribute)(x)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("true_sequential", [False, True], ids=["two-runs", "true-sequential"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_expert_gets_the_hessian_of_only_the_tokens_the_router_sends_it(
    tmp_path, monkeypatch, family, true_sequential
):
    """The routing and the block's inputs are the float model's by default; with true
    sequential, those of the model as written: attention and the router are quantized before
    the experts see their tokens (every tensor a waiting pass holds parked on disk meanwhile,
    whatever its size: the routing, the block's inputs, the experts' outputs so far)."""
    from qtool.calibration import true_sequential as module

    monkeypatch.setattr(module, "PARK_AT_LEAST", 0)
    model_folder = tiny_moe(tmp_path / family, family, dtype=torch.float32)
    named = ["re:.*\\.gate\\.weight=int4:g32"]  # the router, kept in float unless named (issue 42 item 14)
    plan = calibrate_plan(
        model_folder, tmp_path / "out", text_file(tmp_path), true_sequential=true_sequential, tensor_schemes=named
    )
    tokens = plan.calibration.tokens
    reference = model_folder
    if true_sequential:
        api.run(plan)
        reference = tmp_path / "written"
        api.dequantize(tmp_path / "out", reference, dtype="f32")
        plan = calibrate_plan(model_folder, tmp_path / "again", text_file(tmp_path), tensor_schemes=named)
    seen = statistics_of_layer(plan, 0, true_sequential=true_sequential)
    stored, attribute, (gate, up, down) = NAMES[family]

    theirs = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    routed: dict[int, list] = {e: [] for e in range(4)}
    everything = []

    def hook(module, args):
        hidden, top_k_index = args[0], args[1]
        everything.append(hidden.double())
        for e in routed:
            routed[e].append(hidden[(top_k_index == e).any(dim=-1)].double())

    getattr(theirs.model.layers[0], attribute).experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        for row in tokens:
            theirs(input_ids=row.unsqueeze(0))
    all_tokens = torch.cat(everything)
    prefix = f"model.layers.0.{stored}"
    for e, parts in routed.items():
        x = torch.cat(parts)
        assert 0 < x.shape[0] < all_tokens.shape[0], "every expert sees some tokens, none sees all"
        expected = x.T @ x
        ours = seen[f"{prefix}.experts.{e}.{gate}.weight"].double()
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
        assert torch.equal(
            seen[f"{prefix}.experts.{e}.{gate}.weight"], seen[f"{prefix}.experts.{e}.{up}.weight"]
        )  # one input, one X^T X
        assert seen[f"{prefix}.experts.{e}.{down}.weight"].shape == (128, 128)
    router = seen[f"{prefix}.gate.weight"].double()  # the router reads every token
    torch.testing.assert_close(router, all_tokens.T @ all_tokens, rtol=1e-4, atol=1e-4 * float(router.abs().max()))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_expert_no_token_reaches_is_rounded_to_nearest_not_zeroed(tmp_path, family):
    """32 experts, top 1, 16 calibration tokens: at least half the experts of each layer see
    none. They come out as round to nearest gives them (GPTQ would zero the columns it never
    saw), the report names them, and the experts that saw tokens are GPTQ's, not RTN's."""
    from safetensors.torch import load_file

    model_folder = tiny_moe(tmp_path / family, family, experts=32, top_k=1)
    out = tmp_path / "out"
    report = api.run(calibrate_plan(model_folder, out, text_file(tmp_path), samples=2, seq_len=8))
    layers = report.to_json()["calibration"]["layers"]
    unrouted = [name for layer in layers for name in layer["unrouted"]]
    assert all(len(layer["unrouted"]) >= 3 * 16 for layer in layers), [
        len(layer["unrouted"]) for layer in layers
    ]  # 3 Linears per expert
    assert all(".experts." in name for name in unrouted)
    routed = [n for layer in layers for n in layer["weights"] if ".experts." in n and n not in unrouted]
    assert routed
    api.dequantize(out, tmp_path / "ours.safetensors", dtype="f32")
    ours = load_file(str(tmp_path / "ours.safetensors"))
    original = load_file(str(model_folder / "model.safetensors"))

    def rounded(name: str) -> torch.Tensor:
        """int4 sym g32 round to nearest of the float32 weight (bf16 scales absmax / 7.5),
        decoded as compressed-tensors decodes a bf16 model: code times scale in bf16."""
        w = original[name].float().reshape(-1, 32)
        scale = (w.abs().amax(dim=1, keepdim=True) / 7.5).to(torch.bfloat16)
        codes = (w / scale.float()).round().clamp(-8, 7)
        return (codes.to(torch.bfloat16) * scale).float().reshape(original[name].shape)

    for name in unrouted:
        assert torch.equal(ours[name], rounded(name)), name
        assert float(ours[name].abs().sum()) > 0
    assert all(not torch.equal(ours[name], rounded(name)) for name in routed)


@pytest.mark.parametrize("algorithm", ["gptq", "awq", "gptq-true-sequential"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_calibrated_mixture_loads_in_transformers_with_its_experts_decoded_as_qtool_does(
    tmp_path, monkeypatch, family, algorithm
):
    from safetensors.torch import load_file

    from qtool.formats import open_checkpoint
    from qtool.inspection import inspect_checkpoint

    true_sequential = algorithm == "gptq-true-sequential"
    if true_sequential:
        in_one_run_only(monkeypatch)
    model_folder = tiny_moe(tmp_path / family, family)
    out, plain = tmp_path / "out", tmp_path / "plain"
    plan = api.prepare_quantize(
        model_folder, out, "int4:g32", calibrate=text_file(tmp_path), samples=4, seq_len=32, algorithm="gptq" if true_sequential else algorithm, true_sequential=true_sequential
    )  # fmt: skip
    document = api.run(plan).to_json()
    stored, attribute, (gate, up, down) = NAMES[family]
    per_layer = 4 + 3 * 4  # attention, the experts' Linears (the router stays in float: issue 42 item 14)
    assert [len(layer["weights"]) for layer in document["calibration"]["layers"]] == [per_layer, per_layer]
    assert document["summary"]["quantized_weights"] == 2 * per_layer
    assert all(layer["output_rel_mse"] < 0.05 for layer in document["calibration"]["layers"])
    api.dequantize(out, plain)
    ours = load_file(str(plain / "model.safetensors"))

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    for index in range(2):
        block = getattr(loaded.model.layers[index], attribute)
        prefix = f"model.layers.{index}.{stored}"
        for e in range(4):
            fused = torch.cat([ours[f"{prefix}.experts.{e}.{gate}.weight"], ours[f"{prefix}.experts.{e}.{up}.weight"]])
            assert torch.equal(block.experts.gate_up_proj[e].detach(), fused.to(torch.bfloat16)), (prefix, e)
            assert torch.equal(
                block.experts.down_proj[e].detach(), ours[f"{prefix}.experts.{e}.{down}.weight"].to(torch.bfloat16)
            )
        assert torch.equal(block.gate.weight.detach(), ours[f"{prefix}.gate.weight"].to(torch.bfloat16))
    assert loaded.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    checkpoint = open_checkpoint(str(out))
    try:
        labels = {w.scheme.label for w in inspect_checkpoint(checkpoint).weights if w.quantized}
    finally:
        checkpoint.close()
    assert labels == {"int4 sym g32"}


def test_a_checkpoint_with_its_experts_fused_in_3d_is_refused_in_one_line(tmp_path):
    """transformers' own state dict (experts.gate_up_proj [E, 2I, H]) saved as is: no per-expert
    2-D weight to calibrate; nothing is written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qtool.errors import UsageError

    source = tiny_moe(tmp_path / "moe", "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, fused / name)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(fused / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with safe_open(str(fused / "model.safetensors"), "pt") as stored:
        assert stored.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 256, 64]
    with pytest.raises(UsageError, match=r"names no per-expert 2-D weights for mlp\.experts"):
        calibrate_plan(fused, tmp_path / "out", text_file(tmp_path))
    assert not (tmp_path / "out").exists()
