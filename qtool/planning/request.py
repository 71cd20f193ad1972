"""What a quantization is asked to do, decided once from the options and frozen: the selection
(a scheme, or a llama.cpp mix), the output and the layout asked for (whether it is GGUF is
decided here, and only here), and one tagged calibration value that carries what its stage
needs:

    None           no calibration: each weight's codes from the weight alone
    Gptq           GPTQ on token windows of a text (samples, seq_len, seed, actorder, true sequential)
    Awq            AWQ's scale search on the same windows
    Rtn            the text checked, the codes round-to-nearest (the baseline)
    ImatrixText    a GGUF output weighed by llama.cpp's importance matrix computed on the text
    ImatrixFile    a GGUF output weighed by an importance-matrix file (`--imatrix`)

Nothing here reads a file: the checkpoint, the text and the matrix are read when the request
is planned (`qtool.planning.quantize`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Sequence

from qtool.calibration.algorithms import ALGORITHMS, check_algorithm
from qtool.errors import UsageError

if TYPE_CHECKING:
    from qtool.selection import Selection

__all__ = [
    "Gptq",
    "Awq",
    "Rtn",
    "ImatrixText",
    "ImatrixFile",
    "Calibration",
    "QuantizeRequest",
    "ALGORITHMS",
    "resolve_actorder",
]

DEFAULT_ACTORDER = "static"  # llm-compressor 0.14's GPTQModifier writes this unless told otherwise
NO_ACTORDER = "none"  # the columns in their stored order


@dataclass(frozen=True)
class Gptq:
    text: str
    samples: int
    seq_len: int
    seed: int
    actorder: str | None  # the column order the run uses ("static", "weight"), None for the stored order
    true_sequential: bool = False
    algorithm = "gptq"


@dataclass(frozen=True)
class Awq:
    text: str
    samples: int
    seq_len: int
    seed: int
    algorithm = "awq"


@dataclass(frozen=True)
class Rtn:
    text: str
    samples: int
    seq_len: int
    seed: int
    algorithm = "rtn"


@dataclass(frozen=True)
class ImatrixText:
    text: str
    chunks: int
    chunk_size: int
    mix: str | None  # the llama.cpp file type chosen, whose rules say which types need the matrix
    algorithm = "imatrix"


@dataclass(frozen=True)
class ImatrixFile:
    path: str  # as the user gave it: recorded in the output as quantize.imatrix.file
    mix: str | None


Calibration = Gptq | Awq | Rtn | ImatrixText | ImatrixFile | None
TextCalibration = Gptq | Awq | Rtn


@dataclass(frozen=True)
class QuantizeRequest:
    """A quantization, every option checked that can be checked without reading a file."""

    path: str | os.PathLike[str]
    output: str
    selection: Selection
    layout: (
        str | None
    )  # the layout asked for: "gguf" for a .gguf output or a mix, else as given ("auto": the first that stores every scheme)
    calibration: Calibration = None
    dtype: str | None = None
    max_shard_size: str | None = None
    allow_requantize: bool = False
    report: str | None = None
    html: str | None = None
    allow_incomplete_gguf: bool = False

    @property
    def to_gguf(self) -> bool:
        return self.layout == "gguf"

    @classmethod
    def from_options(
        cls,
        path: str | os.PathLike[str],
        output: str | os.PathLike[str],
        scheme: str,
        *,
        include: Sequence[str] = (),
        ignore: Sequence[str] = (),
        tensor_schemes: Sequence[str] = (),
        layout: str | None = "auto",
        dtype: str | None = None,
        max_shard_size: str | None = None,
        allow_requantize: bool = False,
        report: str | os.PathLike[str] | None = None,
        allow_incomplete_gguf: bool = False,
        pure: bool = False,
        html: str | os.PathLike[str] | None = None,
        observer: str | None = None,
        calibrate: str | os.PathLike[str] | None = None,
        algorithm: str | None = None,
        samples: int = 128,
        seq_len: int = 512,
        seed: int = 0,
        actorder: str | None = None,
        true_sequential: bool = False,
        imatrix: str | os.PathLike[str] | None = None,
    ) -> QuantizeRequest:
        from qtool.selection import Selection

        if calibrate is None and algorithm is not None:
            raise UsageError(
                "an algorithm needs calibration text", hint="give the text to calibrate on", option="algorithm"
            )
        if calibrate is None and actorder is not None:
            raise UsageError(
                "an activation order needs calibration text (it orders GPTQ's columns)",
                hint="give the text to calibrate on",
                option="actorder",
            )
        if calibrate is None and true_sequential:
            raise UsageError(
                "true sequential GPTQ needs calibration text",
                hint="give the text to calibrate on",
                option="true_sequential",
            )
        selection = Selection.from_options(
            scheme, list(include), list(ignore), list(tensor_schemes), pure=pure, observer=observer
        )
        output = os.fspath(output)
        mix = selection.mix.name if selection.mix is not None else None
        asked = "gguf" if layout in (None, "auto") and (output.endswith(".gguf") or mix is not None) else layout
        calibration: Calibration = None
        if calibrate is not None and imatrix is not None:
            raise UsageError(
                "give either an importance matrix or calibration text, not both",
                hint="the calibration text computes the importance matrix an imatrix file holds; drop the file",
                option="imatrix",
            )
        if imatrix is not None:
            calibration = ImatrixFile(os.fspath(imatrix), mix)
        elif calibrate is not None and asked == "gguf":
            if algorithm not in (None, "imatrix"):
                raise UsageError(
                    f"algorithm {algorithm!r}: a calibrated GGUF is weighed by llama.cpp's importance matrix",
                    hint="drop the algorithm, or write compressed-tensors for gptq",
                    option="algorithm",
                )
            calibration = ImatrixText(os.fspath(calibrate), samples, seq_len, mix)
        elif calibrate is not None:
            calibration = _text_calibration(
                os.fspath(calibrate), algorithm or "gptq", samples, seq_len, seed, actorder, true_sequential
            )
        return cls(
            path, output, selection, asked, calibration, dtype, max_shard_size, allow_requantize,
            os.fspath(report) if report is not None else None, os.fspath(html) if html is not None else None, allow_incomplete_gguf,
        )  # fmt: skip


def _text_calibration(
    text: str, algorithm: str, samples: int, seq_len: int, seed: int, actorder: str | None, true_sequential: bool
) -> TextCalibration:
    check_algorithm(algorithm)  # the steps' table, `qtool.calibration.algorithms`: one list of names
    order = resolve_actorder(actorder, algorithm)
    if true_sequential and algorithm != "gptq":
        raise UsageError(
            f"true sequential orders GPTQ's Linears; {algorithm} quantizes each layer from its float run",
            hint="leave true sequential out, or use the gptq algorithm",
            option="true_sequential",
        )
    if algorithm == "gptq":
        return Gptq(text, samples, seq_len, seed, order, true_sequential)
    return Awq(text, samples, seq_len, seed) if algorithm == "awq" else Rtn(text, samples, seq_len, seed)


def resolve_actorder(actorder: str | None, algorithm: str) -> str | None:
    """GPTQ's column order as the run uses it: the asked one checked, llm-compressor's default
    ("static") when none was asked, None for `none` and for algorithms without columns to order."""
    from qtool.calibration.gptq import ACTORDERS

    if actorder is None:
        return DEFAULT_ACTORDER if algorithm == "gptq" else None
    if actorder == NO_ACTORDER:
        return None
    if actorder in ("group", "dynamic"):
        raise UsageError(
            f"activation order {actorder!r} (columns regrouped, a weight_g_idx per weight) is gone from compressed-tensors since 0.19, which refuses its config",
            hint="use the activation order weight (or its alias static): the same column order, groups unchanged", option="actorder",
        )  # fmt: skip
    if actorder not in ACTORDERS:
        raise UsageError(
            f"activation order {actorder!r} is not one of {', '.join((*ACTORDERS, NO_ACTORDER))}", option="actorder"
        )
    if algorithm != "gptq":
        raise UsageError(
            f"an activation order orders GPTQ's columns; {algorithm} has none to order",
            hint="leave the activation order out, or use the gptq algorithm",
            option="actorder",
        )
    return actorder
