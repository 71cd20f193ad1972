"""qtool.formats.untrusted_json: the limits of `parse_json`, the typed specs, and every consumer
fed random JSON where it reads a config: the only exception that may come out is a
CheckpointError (exit 2, one line naming the file)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtool.conventions import resolve
from qtool.errors import CheckpointError
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.loader import open_checkpoint
from qtool.formats.untrusted_json import (
    MAX_DEPTH,
    MAX_INT_DIGITS,
    AnyOf,
    Boolean,
    Constant,
    Integer,
    JsonTypeError,
    ListOf,
    MapOf,
    Number,
    Record,
    String,
    parse_json,
)
from tests.conftest import write_safetensors

# -- parse_json ---------------------------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@given(st.integers(min_value=1, max_value=3000))
@settings(max_examples=60, deadline=None)
def test_depth_is_limited_whatever_it_is(depth):
    if depth <= MAX_DEPTH:
        assert parse_json(nested(depth), "x.json") == json.loads(nested(depth))
    else:
        with pytest.raises(CheckpointError, match=f"^x.json: nests deeper than {MAX_DEPTH} levels$"):
            parse_json(nested(depth), "x.json")


def test_depth_past_the_recursion_limit():
    with pytest.raises(CheckpointError, match="nests deeper"):
        parse_json('{"a": ' * 200_000 + "1" + "}" * 200_000, "x.json")


@given(st.integers(min_value=1, max_value=20_000), st.booleans())
@settings(max_examples=60, deadline=None)
def test_integer_size_is_limited(digits, negative):
    text = ("-" if negative else "") + "9" * digits
    if digits <= MAX_INT_DIGITS:
        assert parse_json(f"[{text}]", "x.json") == [int(text)]
    else:
        with pytest.raises(CheckpointError, match=f"^x.json: holds an integer of {digits} digits"):
            parse_json(f"[{text}]", "x.json")


def test_floats_nan_and_infinity():
    assert math.isnan(parse_json("NaN", "x.json"))
    assert parse_json("[Infinity, -Infinity, 1.5e300]", "x.json") == [math.inf, -math.inf, 1.5e300]
    for text, why in (
        ("1e400", "overflows a double"),
        ("-1e400", "overflows a double"),
        ("0." + "1" * 200, "number literal of 202"),
    ):
        with pytest.raises(CheckpointError, match=why):
            parse_json(text, "x.json")


def test_size_and_encoding():
    with pytest.raises(CheckpointError, match=r"^x.json: is 11 bytes of JSON \(at most 10\)$"):
        parse_json(b'"123456789"', "x.json", max_bytes=10)
    with pytest.raises(CheckpointError, match=r"^x.json: is not UTF-8 \(byte 1\)$"):
        parse_json(b'"\xff"', "x.json")
    with pytest.raises(
        CheckpointError, match=r'^m.safetensors: __metadata__\["k"\] is not valid JSON at line 1 column 2$'
    ):
        parse_json("{", "m.safetensors", where='__metadata__["k"]')


def test_lone_surrogates_are_refused_pairs_are_text():
    assert parse_json(r'["\ud83d\ude00", "\\ud800"]', "x.json") == ["\U0001f600", "\\ud800"]
    for text in (r'{"\ud800": 1}', r'[["x\udfff"]]', r'"\udc00\ud800"'):
        with pytest.raises(CheckpointError, match="lone UTF-16 surrogate is not Unicode text"):
            parse_json(text, "x.json")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=40,
)


@given(json_values)
@settings(max_examples=300, deadline=None)
def test_any_json_value_round_trips_or_is_refused(value):
    text = json.dumps(value)
    try:
        parsed = parse_json(text, "x.json")
    except CheckpointError as exc:  # only a limit: a huge int, or a float literal too long
        assert "digits" in exc.message or "number literal" in exc.message
        return
    assert json.dumps(parsed) == text


@given(st.binary(max_size=200) | st.text(alphabet='[]{}",:0123456789.eE-+ aNIntfy\\u', max_size=200))
@settings(max_examples=500, deadline=None)
def test_any_bytes_parse_or_fail_with_one_line(raw):
    try:
        parse_json(raw, "x.json")
    except CheckpointError as exc:
        assert "\n" not in str(exc)


# -- specs ------------------------------------------------------------------------------------------


def test_specs_name_the_field_and_what_it_holds():
    spec = Record(
        {
            "n": Integer(min=1, max=8),
            "xs": ListOf(String(), length=2),
            "m": AnyOf(Record({"a": Boolean()}), Constant(False)),
        }
    )
    assert spec.check({"n": 8, "xs": ["a", "b"], "m": False, "other": {}, "none": None}, "q") == {
        "n": 8,
        "xs": ["a", "b"],
        "m": False,
    }
    assert spec.check({"n": None}, "q") == {}  # null reads as absent
    cases = {
        '{"n": true}': "q.n is true, expected an integer from 1 to 8",
        '{"n": 4.0}': "q.n is 4.0, expected an integer from 1 to 8",
        '{"n": 9}': "q.n is 9, expected an integer from 1 to 8",
        '{"xs": ["a"]}': 'q.xs is ["a"], expected a list of 2 of strings',
        '{"xs": ["a", 1]}': "q.xs[1] is 1, expected a string",
        '{"m": true}': "q.m is true, expected an object or false",
        '{"m": {"a": 1}}': "q.m.a is 1, expected true or false",
        "[]": "q is [], expected an object",
    }
    for raw, message in cases.items():
        with pytest.raises(JsonTypeError) as info:
            spec.check(json.loads(raw), "q", "c.json")
        assert str(info.value) == f"c.json: {message}"
    with pytest.raises(JsonTypeError, match=r'^c.json: q\["a b"\] is 1, expected a string$'):
        MapOf(String()).check({"a b": 1}, "q", "c.json")
    with pytest.raises(JsonTypeError, match=r"is NaN, expected a finite number"):
        Number(finite=True).check(math.nan, "q")


def _specs():
    from qtool.conventions import compressed_tensors, fp8, mlx, quanto, qweight_configs, torchao

    return {
        "compressed-tensors": compressed_tensors._CONFIG,
        "fp8": fp8._FP8_CONFIG,
        "mxfp4": fp8._MXFP4_CONFIG,
        "mlx": mlx._CONFIG,
        "gptq": qweight_configs._GPTQ,
        "awq": qweight_configs._AWQ,
        "quanto": quanto._MAP,
        "torchao record": torchao._RECORD,
        "torchao attributes": torchao._ATTRIBUTES,
    }


@pytest.mark.parametrize("consumer", list(_specs()))
@given(value=json_values)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_each_consumer_spec_accepts_or_raises_its_error(consumer, value):
    try:
        _specs()[consumer].check(value, "x", "c.json")
    except JsonTypeError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 400


# -- consumers: random JSON where each convention reads its config ----------------------------------

# One file whose tensors each convention would claim, so every config reader runs.
TENSORS = {
    "ct.weight": ("F8_E4M3", [4, 32]), "ct.weight_scale": ("BF16", [4, 1]),
    "fp8.weight": ("F8_E4M3", [256, 256]), "fp8.weight_scale_inv": ("F32", [2, 2]),
    "oss_blocks": ("U8", [2, 4, 16]), "oss_scales": ("U8", [2, 4]),
    "mlx.weight": ("U32", [4, 8]), "mlx.scales": ("F16", [4, 1]), "mlx.biases": ("F16", [4, 1]),
    "gptq.qweight": ("I32", [16, 64]), "gptq.scales": ("F16", [1, 64]), "gptq.qzeros": ("I32", [1, 8]),
    "quanto.weight._data": ("I8", [4, 8]), "quanto.weight._scale": ("F32", [4, 1]),
    "0._weight_qdata": ("I8", [4, 8]), "0._weight_scale": ("F32", [4, 1]),
}  # fmt: skip
FIELDS = [
    "quant_method", "format", "ignore", "config_groups", "targets", "weights", "num_bits", "type", "symmetric", "strategy",
    "group_size", "block_structure", "weight_block_size", "modules_to_not_convert", "torch_dtype", "mode", "bits",
    "checkpoint_format", "desc_act", "sym", "is_marlin_format", "version", "zero_point", "q_group_size", "w_bit", "mlx",
]  # fmt: skip
METHODS = st.sampled_from(["compressed-tensors", "fp8", "fbgemm_fp8", "mxfp4", "gptq", "awq", None])


@st.composite
def configs(draw):
    """A quantization config naming a toolchain, with random values at the fields qtool reads,
    one level down too (config_groups.g.weights.x)."""
    config = {k: draw(json_values) for k in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True))}
    method = draw(METHODS)
    if method:
        config["quant_method"] = method
    if draw(st.booleans()):
        weights = {k: draw(json_values) for k in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True))}
        config["config_groups"] = {
            "g": {"targets": draw(st.sampled_from([["Linear"], ["re:.*"]]) | json_values), "weights": weights}
        }
    return config


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return open_checkpoint(write_safetensors(tmp_path_factory.mktemp("base") / "model.safetensors", TENSORS))


def with_json(base: Checkpoint, side_files: dict, metadata: dict) -> Checkpoint:
    return Checkpoint(
        path=base.path,
        format="safetensors",
        files=base.files,
        tensors=base.tensors,
        metadata=metadata,
        side_files=side_files,
    )


@given(config=configs(), mlx=json_values, qmap=json_values, quantize_config=json_values)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_conventions_given_random_configs_raise_only_checkpoint_errors(base, config, mlx, qmap, quantize_config):
    side_files = {
        "config.json": {
            "quantization_config": config,
            "quantization": mlx if not isinstance(mlx, dict) else {"bits": 4, **mlx},
        },
        "quanto_qmap.json": qmap,
        "quantize_config.json": quantize_config,
    }
    try:
        resolve(with_json(base, side_files, {}))
    except CheckpointError as exc:
        assert "\n" not in str(exc)


def maybe(good, bad=json_values):
    return st.just(good) | bad


records = st.fixed_dictionaries(
    {
        "_type": maybe(
            "IntxUnpackedToInt8Tensor", st.sampled_from(["Int8Tensor", "Float8Tensor", "Int4Tensor"]) | json_values
        )
    },
    optional={
        "_tensor_data_names": maybe(["qdata", "scale"]),
        "_data": st.fixed_dictionaries(
            {},
            optional={
                "shape": maybe([4, 8]),
                "block_size": maybe([1, 8]),
                "dtype": maybe("float32"),
                "target_dtype": maybe("int4"),
            },
        )
        | json_values,
    },
)


@given(names=maybe(["0.weight"]), record=records | json_values, ct=configs())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_conventions_given_random_metadata_json_raise_only_checkpoint_errors(base, names, record, ct):
    metadata = {
        "tensor_names": json.dumps(names),
        "0.weight": json.dumps(record),
        "quantization_config": json.dumps({**ct, "quant_method": "compressed-tensors"}),
    }
    try:
        resolve(with_json(base, {}, metadata))
    except CheckpointError as exc:
        assert "\n" not in str(exc)
