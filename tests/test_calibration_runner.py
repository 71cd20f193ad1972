"""The sequential calibration runner on tiny random-weight models that transformers builds from
its own configs (2 layers, small hidden sizes), checked against transformers running the whole
model: the Hessian of a Linear is X^T X of the inputs transformers' own model gives it; the
second layer sees the QUANTIZED first layer's outputs (not the float ones); every family's
output loads in transformers with compressed-tensors, generates, and decompresses to exactly
what `qtool dequantize` gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from qtool import api  # noqa: E402
from tests.conftest import SAMPLES  # noqa: E402

TINY = SAMPLES / "tiny-llama"
TEXT = (
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple "
    "or list) or other iterable object. The expression list is evaluated once; it should yield an "
    "iterable object. An iterator is created for the result of that iterable. "
) * 8

FAMILIES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
}
# a sliding window shorter than the calibration windows, alternating with global attention, so a
# layer given another layer's mask (or Gemma 3's other rotary embedding) computes other values
SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
EXTRA = {
    "gemma2": SLIDING,
    "gemma3": SLIDING,
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},  # its defaults lie outside the tiny vocabulary
}
LINEARS_PER_LAYER = {"phi3": 4}  # fused qkv_proj and gate_up_proj; the others 7


def tiny_model(folder, family: str, dtype=torch.bfloat16):
    """A 2-layer random-weight model of `family`, hidden 64, with tiny-llama's tokenizer."""
    config = getattr(transformers, FAMILIES[family])(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, **EXTRA.get(family, {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder)
    if family in BYTE_LEVEL_TOKENIZER:  # transformers gives these their own tokenizer class, whatever the files say
        _byte_level_tokenizer(folder)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY / name, folder / name)
    return folder


BYTE_LEVEL_TOKENIZER = ("qwen2", "qwen3")


def _byte_level_tokenizer(folder) -> None:
    """A Qwen2-style byte-level BPE with no merges: the 256 byte symbols are the vocabulary
    (ids 0-255, inside the tiny model's vocab_size), as GPT-2's bytes_to_unicode maps them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    vocab = {chr(code): byte for byte, code in zip(printable, codes)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 256})
    )


def text_file(tmp_path, text=TEXT):
    path = tmp_path / "text.txt"
    path.write_text(text)
    return path


def captured_inputs(model_folder, module_name: str, tokens):
    """X^T X of the inputs transformers' own float32 model gives `module_name` on `tokens`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    module = model.get_submodule(module_name)
    total = torch.zeros((module.in_features, module.in_features), dtype=torch.float64)

    def hook(module, args):
        nonlocal total
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        total += x.T @ x

    module.register_forward_pre_hook(hook)
    with torch.no_grad():
        for row in tokens:
            model(input_ids=row.unsqueeze(0))
    return total


def calibrate_plan(model, out, text, scheme="int4:g32", samples=4, seq_len=32, **options):
    return api.prepare_quantize(model, out, scheme, calibrate=text, samples=samples, seq_len=seq_len, **options)


def in_one_run_only(monkeypatch) -> None:
    """Every layer GPTQ'd in one true-sequential run: a layer the runner would do in two passes
    (no one order of its Linears) fails the test. And every tensor a waiting pass holds parked,
    whatever its size, so the tiny models' few-kB tensors go through the parking too."""
    from qtool.calibration import gptq_step, true_sequential

    def refused(index, layer, *args):
        raise AssertionError(f"layer {index} ({type(layer).__name__}) was calibrated in two passes")

    monkeypatch.setattr(gptq_step, "_gptq_layer_in_two_passes", refused)
    monkeypatch.setattr(true_sequential, "PARK_AT_LEAST", 0)


def hessians_of_layer(plan, tokens, index: int, *, true_sequential: bool = False) -> dict:
    """{weight name: its Hessian} of layer `index`, as the runner computes them on `tokens`."""
    from qtool.calibration.runner import RunnerOptions, calibrate

    seen = {}
    try:
        calibrate(
            plan.source, [j.weight for j in plan.jobs], {j.weight.name: j.scheme for j in plan.jobs if j.scheme is not None},
            plan.layout, tokens, RunnerOptions(true_sequential=true_sequential, actorder=plan.calibration.actorder),
            on_statistics=lambda at, name, hessian: seen.update({name: hessian.clone()}) if at == index else None,
        )  # fmt: skip
    finally:
        plan.source.close()
    return seen


def relative(ours, expected) -> float:
    return float((ours.double() - expected).norm() / expected.norm())


def written(model, tmp_path, scheme: str, *, true_sequential: bool = False):
    """The calibration tokens, and the model as qtool writes it calibrated with `scheme`, dequantized to float32."""
    out, plain = tmp_path / "out", tmp_path / "dequantized"
    plan = calibrate_plan(model, out, text_file(tmp_path), scheme=scheme, true_sequential=true_sequential)
    tokens = plan.calibration.tokens
    api.run(plan)
    api.dequantize(out, plain, dtype="f32")
    return tokens, plain


LAYER_0 = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + [
    f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")
]


def shared_inputs_share_their_hessian(seen) -> None:
    """Linears on one input share its X^T X (and GPTQ's factor of it), equal bit for bit."""
    q, k, v, o, gate, up, _ = (seen[name + ".weight"] for name in LAYER_0)
    assert torch.equal(q, k) and torch.equal(q, v) and torch.equal(gate, up)
    assert not torch.equal(q, o)


def test_the_hessian_is_xtx_of_the_inputs_transformers_gives_the_linear(tmp_path):
    """By default (llm-compressor's way) every Hessian of a layer comes from its float run:
    X^T X of what transformers' float model gives each Linear."""
    plan = calibrate_plan(TINY, tmp_path / "out", text_file(tmp_path))
    tokens = plan.calibration.tokens
    seen = hessians_of_layer(plan, tokens, 0)
    for name in LAYER_0:
        expected = captured_inputs(TINY, name, tokens)
        torch.testing.assert_close(
            seen[name + ".weight"].double(), expected, rtol=1e-4, atol=1e-3 * float(expected.abs().max())
        )
    shared_inputs_share_their_hessian(seen)


def test_true_sequential_hessians_are_xtx_of_the_inputs_with_the_linears_before_as_written(tmp_path):
    """With true_sequential each Linear's Hessian is X^T X of the inputs transformers' model
    gives it with the Linears before it as qtool wrote them (those after it cannot change its
    inputs, so the model as written gives them all); o_proj's and down_proj's are far from
    what the float model gives them."""
    tokens, plain = written(TINY, tmp_path, "int2:g32", true_sequential=True)  # a coarse scheme: a clear difference
    seen = hessians_of_layer(
        calibrate_plan(TINY, tmp_path / "again", text_file(tmp_path), scheme="int2:g32"),
        tokens,
        0,
        true_sequential=True,
    )
    assert sorted(seen) == sorted(name + ".weight" for name in LAYER_0)
    for name in LAYER_0:
        assert relative(seen[name + ".weight"], captured_inputs(plain, name, tokens)) < 1e-3, name
    for name in (LAYER_0[3], LAYER_0[6]):
        assert relative(seen[name + ".weight"], captured_inputs(TINY, name, tokens)) > 1e-2, name
    q = seen[LAYER_0[0] + ".weight"]
    torch.testing.assert_close(
        q.double(), captured_inputs(TINY, LAYER_0[0], tokens), rtol=1e-4, atol=1e-3 * float(q.abs().max())
    )
    shared_inputs_share_their_hessian(seen)


@pytest.mark.parametrize("true_sequential", [False, True], ids=["two-runs", "true-sequential"])
@pytest.mark.parametrize("family", ["tiny-llama", "gemma2", "gemma3"])
def test_the_second_layer_sees_the_quantized_first_layers_outputs(tmp_path, family, true_sequential):
    """Layer 1's Hessians are the ones transformers computes with layer 0's weights as written
    (dequantized) and far from the ones with layer 0's float weights. In Gemma 2/3 layer 1
    attends globally and layer 0 through a sliding window: layer 1 gets its own mask, and
    o_proj's inputs, layer 1's attention outputs, show it (its mask and rotary embedding count;
    layer 1's weights float by default, as when its Hessians are taken; as written, true sequential)."""
    from safetensors.torch import load_file, save_file

    model = TINY if family == "tiny-llama" else tiny_model(tmp_path / family, family, dtype=torch.float32)
    tokens, plain = written(model, tmp_path, "int2:g32", true_sequential=true_sequential)
    seen = hessians_of_layer(
        calibrate_plan(model, tmp_path / "again", text_file(tmp_path), scheme="int2:g32"),
        tokens,
        1,
        true_sequential=true_sequential,
    )
    name = "model.layers.1.self_attn.q_proj"
    ours = seen[name + ".weight"]
    assert (
        relative(ours, captured_inputs(plain, name, tokens))
        < 1e-3
        < relative(ours, captured_inputs(model, name, tokens)) / 10
    )
    reference = plain
    if not true_sequential:
        reference = tmp_path / "hybrid"
        shutil.copytree(plain, reference)
        tensors = load_file(str(plain / "model.safetensors"))
        original = load_file(str(Path(model) / "model.safetensors"))
        tensors.update({k: v.float() for k, v in original.items() if k.startswith("model.layers.1.")})
        save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
    name = "model.layers.1.self_attn.o_proj"
    assert relative(seen[name + ".weight"], captured_inputs(reference, name, tokens)) < 1e-3


def test_a_layer_without_one_order_of_its_linears_is_calibrated_in_two_runs(tmp_path, monkeypatch):
    """A layer that has no one order of its Linears (one called twice) cannot be quantized in
    one run (a Linear would be quantized before all its inputs came): true sequential finds
    that on its float run of the first sample and does that layer as llm-compressor does, every
    Hessian from the float layer."""
    from qtool.calibration import gptq_step, layers, true_sequential

    plan = calibrate_plan(TINY, tmp_path / "out", text_file(tmp_path))
    tokens = plan.calibration.tokens
    plan.source.close()
    passes = []
    real = gptq_step._gptq_layer_in_two_passes
    monkeypatch.setattr(gptq_step, "_gptq_layer_in_two_passes", lambda *args: passes.append(args[0]) or real(*args))
    monkeypatch.setattr(
        true_sequential, "order", lambda layer, hidden, kwargs, linears, out: layers.run(layer, hidden, kwargs, out)
    )
    seen = hessians_of_layer(
        calibrate_plan(TINY, tmp_path / "again", text_file(tmp_path)), tokens, 0, true_sequential=True
    )
    assert passes == [0, 1]
    name = LAYER_0[3]
    torch.testing.assert_close(
        seen[name + ".weight"].double(),
        captured_inputs(TINY, name, tokens),
        rtol=1e-4,
        atol=1e-3 * float(seen[name + ".weight"].abs().max()),
    )


def test_true_sequential_parks_each_waiting_input_and_writes_what_it_would_without(tmp_path, monkeypatch):
    """While the passes wait at a Linear, each one's input (the normed hidden states at q and
    at gate, the attention's output at o, the MLP's [seq, intermediate] product at down), its
    Gram taken as it arrived, and the other tensors its frames hold (the queries, keys and
    values at o) are parked on disk; the checkpoint written is byte for byte the one written
    with everything kept in memory."""
    from qtool.calibration import true_sequential
    from qtool.calibration.spill import Parking

    monkeypatch.setattr(true_sequential, "PARK_AT_LEAST", 0)  # the tiny model's tensors are a few kB
    model = tiny_model(tmp_path / "llama", "llama", dtype=torch.float32)
    parked = []
    real = Parking.park
    monkeypatch.setattr(Parking, "park", lambda self, tensor: parked.append(tuple(tensor.shape)) or real(self, tensor))
    api.run(calibrate_plan(model, tmp_path / "parked", text_file(tmp_path), true_sequential=True))
    counts = {shape: parked.count(shape) for shape in set(parked)}
    assert counts[(1, 32, 128)] == 4 * 2  # the MLP's product at down_proj: every sample's, in both layers
    assert (
        counts[(1, 4, 32, 16)] == 4 * 2 and counts[(1, 2, 32, 16)] == 2 * 4 * 2
    )  # the queries, keys, values at o_proj
    assert counts[(1, 32, 64)] >= 4 * 3 * 2  # the normed hidden states at q and gate, the attention's output at o
    monkeypatch.setattr(Parking, "park", lambda self, tensor: None)
    api.run(calibrate_plan(model, tmp_path / "kept", text_file(tmp_path), true_sequential=True))
    ours, kept = ((tmp_path / folder / "model.safetensors").read_bytes() for folder in ("parked", "kept"))
    assert ours == kept


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(
    "scheme, true_sequential", [("int4:g32", False), ("int4:g32:asym", False), ("int4:g32", True)], ids=["sym", "asym", "sym-true-sequential"]
)  # fmt: skip
def test_each_family_end_to_end_loads_in_transformers_and_decodes_as_qtool_does(
    tmp_path, monkeypatch, family, scheme, true_sequential
):
    from safetensors.torch import load_file

    if true_sequential:
        in_one_run_only(monkeypatch)
    model = tiny_model(tmp_path / family, family)
    out, plain = tmp_path / "out", tmp_path / "plain"
    report = api.run(calibrate_plan(model, out, text_file(tmp_path), scheme=scheme, true_sequential=true_sequential))
    document = report.to_json()
    assert [layer["layer"] for layer in document["calibration"]["layers"]] == [0, 1]
    per_layer = LINEARS_PER_LAYER.get(family, 7)
    assert all(len(layer["weights"]) == per_layer for layer in document["calibration"]["layers"])
    assert document["summary"]["quantized_weights"] == 2 * per_layer
    api.dequantize(out, plain)
    ours = load_file(str(plain / "model.safetensors"))

    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    linears = {n: m for n, m in loaded.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert len(linears) == 2 * per_layer
    for name, module in linears.items():
        assert torch.equal(module.weight.detach(), ours[name + ".weight"]), name
    generated = loaded.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)

    from qtool.inspection import inspect_checkpoint
    from qtool.formats import open_checkpoint

    checkpoint = open_checkpoint(out)
    try:
        labels = {w.scheme.label for w in inspect_checkpoint(checkpoint).weights if w.quantized}
    finally:
        checkpoint.close()
    assert labels == {"int4 sym g32" if scheme == "int4:g32" else "int4 asym g32"}


@pytest.mark.parametrize("family", ["tiny-llama", "gemma2", "gemma3", "phi3"])
def test_the_embedding_step_reads_only_the_rows_of_the_samples_tokens_and_gives_the_same_hidden_states(
    tmp_path, family, monkeypatch
):
    """The first layer's inputs from an embedding of only the samples' distinct tokens (ids
    renumbered into it) are bit for bit those from the whole embedding, with Gemma 2's
    normalizer, Gemma 3's scaled embedding and Phi-3's padding index; and the embedding's bytes
    read are those rows' only."""
    from qtool.calibration import runner
    from qtool.calibration.skeleton import Skeleton
    from qtool.formats.checkpoint import Checkpoint

    model = TINY if family == "tiny-llama" else tiny_model(tmp_path / family, family, dtype=torch.float32)
    plan = calibrate_plan(model, tmp_path / "out", text_file(tmp_path), samples=2, seq_len=16)
    tokens = plan.calibration.tokens
    by_name = {j.weight.name: j.weight for j in plan.jobs}
    embedding = by_name["model.embed_tokens.weight"]
    read = []
    original = Checkpoint.read_bytes

    def counting(self, tensor, start=0, size=None):
        if tensor is embedding.data:
            read.append(tensor.nbytes - start if size is None else size)
        return original(self, tensor, start, size)

    monkeypatch.setattr(Checkpoint, "read_bytes", counting)
    try:
        rows_hidden, rows_kwargs = runner.embed(Skeleton.build(plan.source), tokens, by_name, plan.source, "cpu")
        rows_read = sum(read)
        read.clear()
        monkeypatch.setattr(Skeleton, "input_embedding", lambda self: None)
        whole_hidden, _ = runner.embed(Skeleton.build(plan.source), tokens, by_name, plan.source, "cpu")
    finally:
        plan.source.close()
    distinct = int(torch.unique(tokens).numel())
    assert distinct < embedding.shape[0]
    assert rows_read == distinct * embedding.data.nbytes // embedding.shape[0]
    assert sum(read) == embedding.data.nbytes  # the whole-embedding path, for comparison
    assert torch.equal(rows_hidden, whole_hidden)
    assert float(rows_hidden.abs().sum()) > 0


@pytest.mark.parametrize("width", [1, 63, 64, 65, 200, 768, 769, 1000])
def test_the_upper_blocks_mirrored_are_x_transpose_x(width):
    """Each width on both sides of a block step and of the narrow inputs' step: summed over two
    inputs, the upper blocks of X^T X made symmetric are X^T X."""
    from qtool.calibration.gram import mirror as _mirror
    from qtool.calibration.gram import upper_gram as _upper_gram

    generator = torch.Generator().manual_seed(width)
    first, second = (torch.randn(37, width, dtype=torch.float64, generator=generator) for _ in range(2))
    total = torch.zeros(width, width, dtype=torch.float64)
    _upper_gram(first, total, add=True)
    _upper_gram(second, total, add=True)
    _mirror(total)
    both = torch.cat([first, second])
    torch.testing.assert_close(total, both.T @ both, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("entry", ["calibrate", "collect_imatrix"])
def test_a_skeleton_built_by_the_caller_is_not_built_again_and_gives_the_same_result(tmp_path, monkeypatch, entry):
    """Issue 37: the calibration request builds the skeleton to check the architecture; the
    runner's entries take it (`skeleton=`) instead of building a second one, and calibrate
    with it exactly as with their own."""
    from qtool.calibration.imatrix import collect_imatrix
    from qtool.calibration.runner import RunnerOptions, calibrate
    from qtool.calibration.skeleton import Skeleton

    plan = calibrate_plan(TINY, tmp_path / "out", text_file(tmp_path))
    weights, tokens = [j.weight for j in plan.jobs], plan.calibration.tokens
    schemes = {j.weight.name: j.scheme for j in plan.jobs if j.scheme is not None}

    def run(**given):
        if entry == "calibrate":
            result = calibrate(plan.source, weights, schemes, plan.layout, tokens, RunnerOptions(), **given)
            return {name: {key: tensors[key].clone() for key in tensors} for name, tensors in result.encoded.items()}
        stats = collect_imatrix(plan.source, weights, lambda name: name, tokens, **given)
        return {
            name: {"sums": torch.from_numpy(stats.sums[name]), "count": torch.tensor(stats.counts[name])}
            for name in stats.sums
        }

    try:
        built = Skeleton.build(plan.source)
        own = run()
        builds = []
        real = Skeleton.build.__func__
        monkeypatch.setattr(
            Skeleton, "build", classmethod(lambda cls, checkpoint: builds.append(checkpoint) or real(cls, checkpoint))
        )
        given = run(skeleton=built)
    finally:
        plan.source.close()
    assert builds == []
    assert own.keys() == given.keys() and own
    assert all(torch.equal(own[name][key], given[name][key]) for name in own for key in own[name])


@pytest.mark.parametrize("output", ["out", "out.gguf", "imatrix"])
def test_a_calibrated_run_builds_the_skeleton_once(tmp_path, monkeypatch, output):
    """Issue 37: planning builds the model's skeleton to check the architecture and hands that one
    to the run: `quantize --calibrate` (GPTQ, or an importance matrix for a GGUF) and `qtool
    imatrix` build one skeleton each, not one to check and another to run."""
    from qtool.calibration.skeleton import Skeleton

    builds = []
    real = Skeleton.build.__func__
    monkeypatch.setattr(
        Skeleton,
        "build",
        classmethod(lambda cls, checkpoint, *a, **k: builds.append(1) or real(cls, checkpoint, *a, **k)),
    )
    text = text_file(tmp_path)
    if output == "imatrix":
        api.imatrix(TINY, tmp_path / "out.imatrix.gguf", text, chunks=2, chunk_size=32)
    else:
        plan = api.prepare_quantize(
            TINY, tmp_path / output, "int4:g32" if output == "out" else "Q4_K_M", calibrate=text, samples=2, seq_len=32
        )
        api.run(plan)
    assert builds == [1]
