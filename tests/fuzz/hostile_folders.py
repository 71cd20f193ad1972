"""Hostile model folders at calibration's door to transformers (issue 42, items 1, 2 and 5),
written into the regression corpus as `side_json/handmade-calibrate-*` cases by
`python -m tests.fuzz.handmade`. Each folder is a one-layer LLaMA small enough to commit
(hidden 8, vocabulary 256: 21 kB of float32 weights) with tiny-llama's tokenizer, and each case
must end in one `error:` line, exit 2, with nothing but JSON on stdout, though "y" waits on
stdin (`QTOOL_FUZZ_STDIN`) for transformers' "Do you wish to run the custom code? [y/N]":

- `evil-tokenizer-*`: tokenizer_config.json names `auto_map.AutoTokenizer: evil.EvilTokenizer`
  beside an `evil.py` that exits the process with code 99 (so a run of it is the finding
  `other-exit`, not a refusal), through `quantize --calibrate --json`, `imatrix --json` and
  `quantize --calibrate` to GGUF;
- `evil-architecture`: config.json's unknown model_type with `auto_map` to the same file;
- `escape-rope-type`: `rope_scaling.rope_type` holding ESC[2J, an OSC 52 clipboard write and an
  OSC 8 link (an exit 2 whose line holds them raw is still accepted: tests/test_calibration_folders.py
  checks the escaping);
- `unknown-hidden-act`: a KeyError in the layer's constructor before (exit 70);
- `layers-1e9`, `head-dim-2-31`, `hidden-2-31`, `vocab-0`, `ffn-mismatch`: a config the weights
  belie, in `--dry-run` (layers built for ever; 4 GiB of rotary tables; accepted).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["CASES", "calibration_folder", "write_cases"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 8, 2, 1, 4, 16, 256

EVIL = b"import os\nos._exit(99)  # the model folder's own code: it must never run\n"
ESCAPES = "\x1b[2J\x1b]52;c;aGVsbG8=\x07\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07"
TEXT = ("An iterator is created for the result of the expression list. " * 40).encode()


def _config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    config.update(changes)
    return config


def _weights() -> bytes:
    from tests.fuzz.seeds import safetensors_bytes

    shapes = {
        "model.embed_tokens.weight": [VOCAB, HIDDEN],
        "model.layers.0.self_attn.q_proj.weight": [HEADS * HEAD_DIM, HIDDEN],
        "model.layers.0.self_attn.k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
        "model.layers.0.self_attn.v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
        "model.layers.0.self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD_DIM],
        "model.layers.0.mlp.gate_proj.weight": [FFN, HIDDEN],
        "model.layers.0.mlp.up_proj.weight": [FFN, HIDDEN],
        "model.layers.0.mlp.down_proj.weight": [HIDDEN, FFN],
        "model.layers.0.input_layernorm.weight": [HIDDEN],
        "model.layers.0.post_attention_layernorm.weight": [HIDDEN],
        "model.norm.weight": [HIDDEN],
        "lm_head.weight": [VOCAB, HIDDEN],
    }
    tensors = {}
    for index, (name, shape) in enumerate(shapes.items()):
        count = shape[0] * (shape[1] if len(shape) > 1 else 1)
        values = (
            [1.0] * count if name.endswith("norm.weight") else [((i * 7 + index) % 17 - 8) / 64 for i in range(count)]
        )
        tensors[name] = ("F32", shape, struct.pack(f"<{count}f", *values))
    return safetensors_bytes(tensors)


def calibration_folder(
    config: dict | None = None, tokenizer_config: dict | None = None, evil: bool = False
) -> dict[str, bytes]:
    """The case's files: m/ (the model) and text.txt (the calibration text)."""
    from tests.fuzz.seeds import SAMPLES

    tiny = SAMPLES / "tiny-llama"
    files = {
        "m/config.json": json.dumps(config or _config()).encode(),
        "m/model.safetensors": _weights(),
        "m/tokenizer.json": (tiny / "tokenizer.json").read_bytes(),
        "m/tokenizer_config.json": json.dumps(
            tokenizer_config or json.loads((tiny / "tokenizer_config.json").read_text())
        ).encode(),
        "text.txt": TEXT,
    }
    if evil:
        files["m/evil.py"] = EVIL
    return files


def _evil_tokenizer_config() -> dict:
    from tests.fuzz.seeds import SAMPLES

    config = json.loads((SAMPLES / "tiny-llama" / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    return config


_CALIBRATE = [
    "quantize",
    "{in}/m",
    "-o",
    "{out}",
    "--scheme",
    "int8",
    "--calibrate",
    "{in}/text.txt",
    "--samples",
    "2",
    "--seq-len",
    "16",
    "--threads",
    "1",
    "--json",
]
_IMATRIX = [
    "imatrix",
    "{in}/m",
    "-o",
    "{out}.gguf",
    "--calibrate",
    "{in}/text.txt",
    "--chunk-size",
    "16",
    "--chunks",
    "2",
    "--threads",
    "1",
    "--json",
]
_GGUF = [
    "quantize",
    "{in}/m",
    "-o",
    "{out}.gguf",
    "--scheme",
    "Q8_0",
    "--calibrate",
    "{in}/text.txt",
    "--samples",
    "2",
    "--seq-len",
    "16",
    "--threads",
    "1",
    "--json",
]
_DRY = [*_CALIBRATE, "--dry-run"]

# name: (what, argv, the folder's files)
CASES = {
    "evil-tokenizer-calibrate": ("tokenizer_config.json's auto_map names evil.py (which exits 99), quantize --calibrate", _CALIBRATE, lambda: calibration_folder(tokenizer_config=_evil_tokenizer_config(), evil=True)),
    "evil-tokenizer-imatrix": ("tokenizer_config.json's auto_map names evil.py (which exits 99), imatrix", _IMATRIX, lambda: calibration_folder(tokenizer_config=_evil_tokenizer_config(), evil=True)),
    "evil-tokenizer-gguf": ("tokenizer_config.json's auto_map names evil.py (which exits 99), quantize --calibrate to GGUF", _GGUF, lambda: calibration_folder(tokenizer_config=_evil_tokenizer_config(), evil=True)),
    "evil-architecture": (
        "config.json: unknown model_type, auto_map to evil.py (which exits 99)", _CALIBRATE,
        lambda: calibration_folder(_config(model_type="evilarch", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}), evil=True),
    ),
    "escape-rope-type": ("rope_scaling.rope_type holding ESC[2J, OSC 52 and OSC 8", _DRY, lambda: calibration_folder(_config(rope_scaling={"rope_type": ESCAPES, "factor": 2.0}))),
    "unknown-hidden-act": ("hidden_act 'nosuch'", _DRY, lambda: calibration_folder(_config(hidden_act="nosuch"))),
    "layers-1e9": ("num_hidden_layers 10**9 beside one layer", _DRY, lambda: calibration_folder(_config(num_hidden_layers=10**9))),
    "head-dim-2-31": ("head_dim 2**31", _DRY, lambda: calibration_folder(_config(head_dim=2**31))),
    "hidden-2-31": ("hidden_size 2**31", _DRY, lambda: calibration_folder(_config(hidden_size=2**31))),
    "vocab-0": ("vocab_size 0", _DRY, lambda: calibration_folder(_config(vocab_size=0))),
    "ffn-mismatch": ("intermediate_size 8 beside 16-row gate/up weights", _DRY, lambda: calibration_folder(_config(intermediate_size=8))),
}  # fmt: skip


def write_cases(regressions: Path) -> list[Path]:
    from tests.fuzz.campaign import Case

    written = []
    for name, (what, argv, files) in CASES.items():
        case = Case(
            "side_json", "handmade", ".", list(argv), [f"handmade: {what}"], files(), env={"QTOOL_FUZZ_STDIN": "y\n"}
        )
        folder = regressions / "side_json" / f"handmade-calibrate-{name}"
        case.write(
            folder,
            extra={
                "area": "calibration",
                "signature": ["handmade", what, "calibration"],
                "expect": {"outcome": "exit2-one-line", "stdout": "json"},
            },
        )
        written.append(folder)
    return written
