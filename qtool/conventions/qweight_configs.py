"""GPTQ and AWQ checkpoints store the same tensor names (qweight, qzeros, scales); which
toolchain wrote one is its config's to say. Both conventions read these two config readers, so
each can leave the other's checkpoint alone.

A config field of the wrong JSON type is refused (exit 2), as AutoGPTQ, GPTQModel, AutoAWQ and
transformers refuse it; a value of the right type that fits no layout (bits 5) is a note on the
weight, and the shapes decide.
"""

from __future__ import annotations

from typing import Any

from qtool.conventions.base import side_file
from qtool.formats.checkpoint import Checkpoint
from qtool.formats.untrusted_json import Boolean, Integer, Record, String

__all__ = ["gptq_config", "awq_config"]


def _method(config: dict[str, Any]) -> str:
    return str(config.get("quant_method") or config.get("method") or "").lower()


# What qtool reads of a GPTQ config (AutoGPTQ's BaseQuantizeConfig, GPTQModel's QuantizeConfig,
# transformers' GPTQConfig)
_GPTQ = Record({
    "bits": Integer(), "group_size": Integer(), "checkpoint_format": String(max_chars=64), "format": String(max_chars=64),
    "is_marlin_format": Boolean(), "desc_act": Boolean(), "sym": Boolean(),
})  # fmt: skip
_GPTQ_HINT = "AutoGPTQ and transformers would refuse this config too; fix the field"


def gptq_config(checkpoint: Checkpoint) -> tuple[dict[str, Any] | None, str | None]:
    """The GPTQ settings and the file they came from: quantize_config.json (AutoGPTQ's own,
    which older files write without a quant_method), else config.json's quantization_config.
    The fields qtool reads are type-checked: a JsonTypeError names the file (exit 2)."""
    side = checkpoint.side_files.get("quantize_config.json")
    if isinstance(side, dict) and _method(side) in ("", "gptq"):
        return _GPTQ.check(side, "", side_file(checkpoint, "quantize_config.json"), _GPTQ_HINT), "quantize_config.json"
    config = checkpoint.config.get("quantization_config")
    if isinstance(config, dict) and _method(config) == "gptq":
        return _GPTQ.check(config, "quantization_config", side_file(checkpoint), _GPTQ_HINT), "config.json"
    return None, None


# What qtool reads of transformers' AwqConfig (AutoAWQ's quant_config names: q_group_size, w_bit)
_AWQ = Record({
    "version": String(max_chars=64), "group_size": Integer(), "q_group_size": Integer(),
    "bits": Integer(), "w_bit": Integer(), "zero_point": Boolean(),
})  # fmt: skip


def awq_config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """config.json's quantization_config when its quant_method is awq, the fields qtool reads
    type-checked (a JsonTypeError names config.json, exit 2); else None."""
    config = checkpoint.config.get("quantization_config")
    if isinstance(config, dict) and str(config.get("quant_method") or "").lower() == "awq":
        return _AWQ.check(
            config,
            "quantization_config",
            side_file(checkpoint),
            "transformers would refuse this config too; fix the field",
        )
    return None
