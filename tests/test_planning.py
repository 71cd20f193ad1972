"""qtool/planning: the quantize request is decided once from the options and frozen (the
container, one tagged calibration value carrying what its stage needs, the mix included), and
planning it gives a value the run does not change."""

from __future__ import annotations

import dataclasses

import pytest

from qtool.errors import UsageError
from qtool.planning.request import Awq, Gptq, ImatrixFile, ImatrixText, QuantizeRequest, Rtn
from tests.conftest import SAMPLES

TINY = SAMPLES / "tiny-llama"


def request(output="out", scheme="W4A16", **options) -> QuantizeRequest:
    return QuantizeRequest.from_options(TINY, output, scheme, **options)


def test_whether_the_output_is_gguf_is_decided_once():
    assert request("out.gguf", "q4_0").layout == "gguf"
    assert request("out", "Q4_K_M").layout == "gguf"  # a mix is GGUF's (the folder is refused when planned)
    assert request("out", "W4A16").layout == "auto"
    assert request("out", "W4A16", layout="compressed-tensors").layout == "compressed-tensors"


def test_one_tagged_calibration_value_carries_what_its_stage_needs():
    assert request().calibration is None
    assert request(calibrate="t.txt") == request(calibrate="t.txt", algorithm="gptq")
    assert request(calibrate="t.txt").calibration == Gptq("t.txt", 128, 512, 0, "static", False)
    assert request(calibrate="t.txt", actorder="none", true_sequential=True).calibration == Gptq(
        "t.txt", 128, 512, 0, None, True
    )
    assert request(calibrate="t.txt", algorithm="awq", samples=8, seq_len=64, seed=3).calibration == Awq(
        "t.txt", 8, 64, 3
    )
    assert request(calibrate="t.txt", algorithm="rtn").calibration == Rtn("t.txt", 128, 512, 0)
    assert request("o.gguf", "Q4_K_M", calibrate="t.txt", samples=4, seq_len=64).calibration == ImatrixText(
        "t.txt", 4, 64, "Q4_K_M"
    )
    assert request("o.gguf", "q4_k", imatrix="m.gguf").calibration == ImatrixFile("m.gguf", None)
    assert request("o.gguf", "IQ2_XS", imatrix="m.gguf").calibration == ImatrixFile("m.gguf", "IQ2_XS")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"algorithm": "awq"}, "an algorithm needs calibration text"),
        ({"calibrate": "t.txt", "imatrix": "m.gguf"}, "give either an importance matrix or calibration text"),
        ({"calibrate": "t.txt", "algorithm": "nosuch"}, "algorithm 'nosuch' is not one of gptq, awq, rtn"),
        (
            {"calibrate": "t.txt", "algorithm": "awq", "actorder": "static"},
            "an activation order orders GPTQ's columns; awq has none to order",
        ),
        ({"calibrate": "t.txt", "algorithm": "rtn", "true_sequential": True}, "true sequential orders GPTQ's Linears"),
        ({"calibrate": "t.txt", "actorder": "group"}, "is gone from compressed-tensors"),
    ],
)
def test_what_the_options_alone_refuse_is_refused_before_any_file_is_read(options, message):
    with pytest.raises(UsageError, match=message):
        request(**options)
    with pytest.raises(UsageError, match="a calibrated GGUF is weighed by llama.cpp's importance matrix"):
        request("o.gguf", "q4_k", calibrate="t.txt", algorithm="gptq")


def test_the_request_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        request().layout = "gguf"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request(calibrate="t.txt").calibration.samples = 1


def test_running_a_plan_leaves_it_as_planned(tmp_path):
    """The run writes what the plan says and changes nothing of it: the same jobs, encodings and
    metadata after as before (the report carries the plan written)."""
    from qtool import api

    plan = api.prepare_quantize(TINY, tmp_path / "out.gguf", "q4_0")
    jobs, metadata = list(plan.jobs), plan.metadata
    report = api.run(plan)
    assert plan.jobs == jobs and all(a is b for a, b in zip(plan.jobs, jobs)) and plan.metadata is metadata
    assert report.plan.jobs == plan.jobs and report.calibration is None and "calibration" not in report.to_json()
