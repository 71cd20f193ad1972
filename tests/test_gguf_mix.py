"""llama.cpp's type mixes (qtool/llamacpp/mixes.py) against the table the real llama-quantize
made (tests/fixtures/gguf_mix/make_reference.py), tensor by tensor, for every mix."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest

from qtool.llamacpp.mixes import (
    LLAMA_CPP_COMMIT,
    MIXES,
    MixTensor,
    ModelFacts,
    allows_quantization,
    choose_types,
    fallback_type,
    llama_order,
    mix_named,
    use_more_bits,
)

REFERENCE = os.path.join(os.path.dirname(__file__), "fixtures", "gguf_mix", "reference.json")


def reference() -> dict:
    with open(REFERENCE) as fh:
        return json.load(fh)


CASES = [(model, mix) for model, entry in reference()["models"].items() for mix in entry["mixes"]]


def mix_of(key: str):
    """The mix a reference key names: "Q4_K_M", "Q2_K --pure" (llama-quantize --pure) or
    "IQ4_XS --imatrix" (llama-quantize --imatrix); and whether there is an imatrix."""
    name, _, flag = key.partition(" ")
    return (replace(MIXES[name], pure=True) if flag == "--pure" else MIXES[name]), flag == "--imatrix"


IMATRIX_MIXES = ["Q4_0", "IQ4_XS", "Q4_K_M", "IQ3_S", "IQ3_M"]


def test_the_table_was_made_from_the_commit_the_rules_name():
    assert reference()["llama_cpp_commit"] == LLAMA_CPP_COMMIT
    plain = {
        name for name, mix in MIXES.items() if not mix.imatrix
    }  # llama-quantize refuses the rest without an imatrix
    pure = {f"{name} --pure" for name in plain if not MIXES[name].pure}
    imatrix = {f"{name} --imatrix" for name in IMATRIX_MIXES + [name for name, mix in MIXES.items() if mix.imatrix]}
    assert {mix for _, mix in CASES} == plain | pure | imatrix


@pytest.mark.parametrize("model, mix", CASES, ids=[f"{m}-{x}" for m, x in CASES])
def test_every_tensor_gets_the_type_llama_quantize_gave_it(model, mix):
    entry = reference()["models"][model]
    tensors = [MixTensor(name, tuple(shape), dtype) for name, shape, dtype in entry["tensors"]]
    rules, has_imatrix = mix_of(mix)
    chosen = choose_types(rules, tensors, ModelFacts(**entry["facts"]), has_imatrix=has_imatrix)
    assert {name: choice.type for name, choice in chosen.items()} == entry["mixes"][mix]


def test_the_reference_exercises_promotions_and_fallbacks():
    """The table is not trivially uniform: without these the test above could pass on a
    rule-free implementation."""
    models = reference()["models"]
    deep = models["deep33"]["mixes"]["Q4_K_M"]
    assert deep["blk.0.ffn_down.weight"] == "Q6_K" and deep["blk.5.ffn_down.weight"] == "Q4_K"
    assert deep["output.weight"] == "Q6_K" and deep["token_embd.weight"] == "Q4_K"
    assert models["gqa8_320"]["mixes"]["Q4_K_M"]["token_embd.weight"] == "Q8_0"  # tied, 320 % 256
    assert models["odd4_272"]["mixes"]["Q8_0"]["blk.0.attn_q.weight"] == "F16"
    assert models["moe8"]["mixes"]["Q4_K_M"]["blk.1.attn_v.weight"] == "Q8_0"
    # an importance matrix changes a few rules: IQ4_XS keeps the first ffn_down layers, Q4_0 gives them Q4_1
    assert deep["blk.0.ffn_down.weight"] == "Q6_K"
    assert models["deep33"]["mixes"]["IQ4_XS"]["blk.0.ffn_down.weight"] == "Q5_K"
    assert models["deep33"]["mixes"]["IQ4_XS --imatrix"]["blk.0.ffn_down.weight"] == "IQ4_XS"
    assert models["deep33"]["mixes"]["Q4_0 --imatrix"]["blk.3.ffn_down.weight"] == "Q4_1"
    assert models["deep33"]["mixes"]["Q4_0 --imatrix"]["blk.4.ffn_down.weight"] == "Q4_0"
    assert models["deep33"]["mixes"]["IQ3_M"]["blk.0.attn_v.weight"] == "Q4_K"
    assert models["gqa8_320"]["mixes"]["IQ3_S"]["blk.0.attn_q.weight"] == "IQ4_NL"  # 320 % 256: the IQ fallback
    iq2 = models["deep33"]["mixes"]["IQ2_M --imatrix"]
    assert (
        iq2["token_embd.weight"] == "IQ3_S"
        and iq2["output.weight"] == "Q5_K"
        and iq2["blk.0.ffn_down.weight"] == "IQ3_S"
    )
    assert models["deep33"]["mixes"]["IQ3_XXS --imatrix"]["blk.0.attn_q.weight"] == "IQ2_S"


def test_llama_order_sorts_by_layer_number_then_name():
    names = ["blk.10.attn_v.weight", "output.weight", "blk.2.attn_v.weight", "blk.2.attn_k.weight", "token_embd.weight"]
    assert llama_order(names) == [
        "output.weight",
        "token_embd.weight",
        "blk.2.attn_k.weight",
        "blk.2.attn_v.weight",
        "blk.10.attn_v.weight",
    ]


def test_counters_follow_llama_order_not_file_order():
    """attn_v of layer 10 listed first in the file is still the 11th attn_v llama.cpp sees."""
    layers = 12
    names = [f"blk.{i}.attn_v.weight" for i in reversed(range(layers))]
    tensors = [MixTensor(n, (256, 256), "F16") for n in names]
    chosen = choose_types(MIXES["Q4_K_M"], tensors, ModelFacts("llama", layers, 4, 4))
    for i in range(layers):
        assert chosen[f"blk.{i}.attn_v.weight"].type == ("Q6_K" if use_more_bits(i, layers) else "Q4_K")


@pytest.mark.parametrize(
    "name, shape, allowed",
    [
        ("blk.0.attn_q.weight", (256, 256), True),
        ("blk.0.attn_norm.weight", (256,), False),
        ("blk.0.attn_q.weight", (1, 256), False),  # ggml counts [1, n] as 1-D
        ("blk.0.ffn_gate_inp.weight", (8, 256), False),
        ("position_embd.weight", (512, 256), False),
        ("blk.0.attn_q.bias", (256, 256), False),
        ("blk.0.ffn_down_exps.weight", (8, 256, 512), True),
    ],
)
def test_which_tensors_llama_cpp_quantizes(name, shape, allowed):
    assert allows_quantization(name, shape, "llama") is allowed


@pytest.mark.parametrize(
    "cols, target, result",
    [
        (320, "Q4_K", "Q5_0"),
        (320, "Q2_K", "Q4_0"),
        (320, "Q5_K", "Q5_1"),
        (320, "Q6_K", "Q8_0"),
        (272, "Q4_K", "F16"),
        (272, "Q8_0", "F16"),
        (512, "Q4_K", "Q4_K"),
    ],
)
def test_row_fallbacks(cols, target, result):
    assert fallback_type(cols, target)[0] == result


def test_mix_names_are_capitals_as_llama_cpp_spells_them():
    assert mix_named("Q4_K_M") is MIXES["Q4_K_M"]
    assert mix_named("q4_k_m") is None and mix_named("q8_0") is None
    assert MIXES["Q4_K"].pure and not MIXES["Q4_K_M"].pure


def test_override_replaces_the_rule_and_does_not_count():
    """llama-quantize --tensor-type: the overridden attn_v is not counted, so the next one
    is the first llama.cpp promotes by rank."""
    tensors = [
        MixTensor(f"blk.{i}.attn_v.weight", (256, 256), "F16", override="Q8_0" if i == 0 else None) for i in range(4)
    ]
    chosen = choose_types(MIXES["Q3_K_M"], tensors, ModelFacts("llama", 4, 4, 4))
    assert [chosen[t.name].type for t in tensors] == ["Q8_0", "Q5_K", "Q5_K", "Q4_K"]


def test_schemes_lists_gguf_types_with_true_bits_and_the_mixes():
    from typer.testing import CliRunner

    from qtool.cli import app

    result = CliRunner().invoke(app, ["schemes", "--json"])
    assert result.exit_code == 0, result.output
    by_name = {(e["name"], e["kind"]): e for e in json.loads(result.stdout)["schemes"]}
    assert by_name[("q4_k", "scheme")]["bits_per_weight"] == 4.5  # 144 bytes per 256 values
    assert by_name[("q6_k", "scheme")]["bits_per_weight"] == 6.5625
    assert by_name[("q8_0", "scheme")]["bits_per_weight"] == 8.5
    llama3_8b_parameters = 8_030_261_248
    for mix in MIXES:
        entry = by_name[(mix, "gguf mix")]
        assert entry["layout"] == "gguf"
        published = re.search(r"\((\d+\.\d+)G,", entry["description"])
        if published:  # llama-quantize's own file size for the mix on Llama-3-8B, in GiB
            size = entry["bits_per_weight"] * llama3_8b_parameters / 8 / 2**30
            assert abs(size - float(published.group(1))) < 0.02, (mix, size, published.group(1))
        elif MIXES[mix].pure:  # pure: the type's own bits, a little more where rows fall back
            assert entry["bits_per_weight"] >= by_name[(mix.lower(), "scheme")]["bits_per_weight"]
        else:  # the IQ mixes: llama-quantize quotes their main type's bits per weight, the mix has a little more
            nominal = float(re.search(r"(\d+\.\d+) bpw", entry["description"]).group(1))
            assert nominal <= entry["bits_per_weight"] < nominal + 0.6, (mix, entry["bits_per_weight"])
    assert "pure" in by_name[("Q4_K", "gguf mix")]["description"]
    assert "Llama-3-8B" in by_name[("Q4_K_M", "gguf mix")]["description"]


def test_a_mix_name_where_one_type_is_wanted_says_so():
    from qtool.errors import SchemeError
    from qtool.scheme_strings import parse_scheme

    with pytest.raises(SchemeError, match="llama.cpp file type"):
        parse_scheme("Q4_K_M")
    assert parse_scheme("Q4_K") == parse_scheme("q4_k")  # where a scheme is one type, both spellings are that type


def test_quantize_help_documents_the_rule_with_examples():
    from typer.testing import CliRunner

    from qtool.cli import app

    text = CliRunner().invoke(app, ["quantize", "--help"], terminal_width=200).output
    assert "Lowercase q8_0" in text and "CAPITALS" in text and "--scheme Q4_K_M" in text
