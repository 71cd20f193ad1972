"""What `qtool quantize` writes, loaded by the real compressed-tensors the way transformers
loads a checkpoint, decompresses to exactly what `qtool dequantize` gives for the same file."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from qtool.cli import app
from tests.conftest import SAMPLES

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config  # noqa: E402

TINY = SAMPLES / "tiny-llama"


def _model_from(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree with an nn.Linear for every 2-D *_proj weight, plain parameters elsewhere."""
    root = nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path[:-1] if path and path[-1].endswith("_proj") else path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if path and path[-1].endswith("_proj"):
            out_features, in_features = tensor.shape
            if not hasattr(module, path[-1]):
                module.add_module(path[-1], nn.Linear(in_features, out_features, bias=False, dtype=tensor.dtype))
        else:
            module.register_parameter(leaf, nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    return root


MSE_PRESETS = [
    "W8A16:mse",
    "W4A16:mse",
    "W4A16_ASYM:mse",
    "int8:channel:mse",
    "int8:channel:asym:mse",
    "int4:g64:asym:mse",
    "int3:g64:mse",
    "int3:g64:asym:mse",
    "int2:g64:mse",
    "int2:g64:asym:mse",
]


@pytest.mark.parametrize(
    "scheme", ["W8A16", "W4A16", "W4A16_ASYM", "FP8", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", *MSE_PRESETS]
)
def test_compressed_tensors_loads_qtool_output_bit_for_bit(tmp_path, scheme):
    runner = CliRunner()
    out, back = tmp_path / "out", tmp_path / "back.safetensors"
    assert runner.invoke(app, ["quantize", str(TINY), "-o", str(out), "--scheme", scheme, "-q"]).exit_code == 0
    assert runner.invoke(app, ["dequantize", str(out), "-o", str(back), "-q"]).exit_code == 0

    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    model = _model_from(load_file(str(TINY / "model.safetensors")))
    apply_quantization_config(model, config)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)  # creates the compressed parameters, shaped as the package expects
    stored = load_file(str(out / "model.safetensors"))
    assert set(model.state_dict()) == set(stored)
    model.load_state_dict(stored, strict=True)
    with contextlib.redirect_stderr(io.StringIO()):
        compressor.decompress_model(model)

    ours = load_file(str(back))
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert len(linears) == 14
    for name, module in linears.items():
        theirs = module.weight.detach()
        assert theirs.dtype == ours[name + ".weight"].dtype
        assert torch.equal(theirs.view(torch.int16), ours[name + ".weight"].view(torch.int16)), name
