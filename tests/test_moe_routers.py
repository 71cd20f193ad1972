"""MoE routers stay in float by default (issue 42 item 14): llm-compressor's and vLLM's
convention (`ignore=["re:.*mlp.gate$"]`; vLLM builds the gate unquantized), since a router is
tiny and routing is sensitive to its error. Named by `--include` or `--tensor-scheme`, one is
quantized as asked."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, SAMPLES

ROUTERS = [
    "model.layers.0.block_sparse_moe.gate.weight",  # Mixtral
    "model.layers.0.mlp.gate.weight",  # Qwen3-MoE, Qwen2-MoE, DeepSeek
    "model.layers.0.mlp.shared_expert_gate.weight",  # Qwen2-MoE's shared expert's gate
    "model.layers.0.feed_forward.router.weight",  # Llama 4
]
LINEARS = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "model.layers.0.mlp.experts.0.gate_proj.weight",
    "model.layers.0.mlp.shared_expert.gate_proj.weight",
]


@pytest.fixture
def moe_names(tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "moe"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(1 if "shared_expert_gate" in name else 8, 128, generator=generator) for name in ROUTERS
    }
    tensors.update({name: torch.randn(64, 128, generator=generator) for name in LINEARS})
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copy(SAMPLES / "tiny-llama" / "config.json", folder / "config.json")
    return folder


def _quantized(plan) -> set[str]:
    return {job.weight.name for job in plan.jobs if job.scheme is not None}


def test_routers_are_kept_in_float_by_default(moe_names, tmp_path):
    from qtool import api

    plan = api.prepare_quantize(moe_names, tmp_path / "out", "W8A16")
    assert _quantized(plan) == set(LINEARS)


def test_a_router_named_is_quantized(moe_names, tmp_path):
    from qtool import api

    plan = api.prepare_quantize(moe_names, tmp_path / "out", "W8A16", tensor_schemes=["re:.*mlp\\.gate\\.weight=W8A16"])
    assert _quantized(plan) == set(LINEARS) | {"model.layers.0.mlp.gate.weight"}
    plan = api.prepare_quantize(moe_names, tmp_path / "out", "W8A16", include=["*"])
    assert _quantized(plan) == set(LINEARS) | set(ROUTERS)


def test_the_cli_keeps_routers_and_check_does_not_ask_for_them(moe_names, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qtool",
            "quantize",
            str(moe_names),
            "-o",
            str(out),
            "--scheme",
            "W8A16",
            "--json",
            "-q",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
        for router in ROUTERS:  # stored as they were: float, no scale beside them
            assert router in names and router.replace(".weight", ".weight_scale") not in names
            assert stored.get_tensor(router).dtype.is_floating_point
        assert all(linear.replace(".weight", ".weight_scale") in names for linear in LINEARS)
    check = subprocess.run(
        [sys.executable, "-m", "qtool", "check", str(out), "--expect-scheme", "W8A16"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert check.returncode == 0, check.stdout + check.stderr
