"""config.json checked against the checkpoint before transformers builds anything from it.

transformers trusts a config: `num_hidden_layers: 1000000000` builds layers until memory runs
out, `head_dim: 2**31` allocates gigabytes of rotary tables, an unknown `hidden_act` is a
KeyError deep in a layer's constructor, and an unknown `rope_type` is logged raw (terminal
escapes and all) before it fails the same way. So before the skeleton is built, in `--dry-run`
too, and in well under a second:

- every size field (`SIZE_FIELDS`) present is a whole number from 1 to the largest dimension of
  any tensor in the checkpoint (a model's widths are the shapes of its weights);
- `num_hidden_layers` is a whole number from 1 to the number of decoder layers the checkpoint
  holds (a checkpoint may hold more: DeepSeek's multi-token-prediction layer);
- the activation (`hidden_act`, `hidden_activation`, `activation_function`) is one transformers
  has, and so is every rotary type (`rope_scaling` / `rope_parameters`, per layer type too).

Then, once the skeleton is built on `meta` (`check_shapes`): every parameter of the decoder
layers exists in the checkpoint with the skeleton's shape, and every other parameter the
checkpoint holds by that name has it. Each refusal is one CheckpointError naming config.json.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from qtool.errors import CheckpointError

if TYPE_CHECKING:
    from qtool.formats.checkpoint import Checkpoint

__all__ = ["check_config", "check_shapes", "SIZE_FIELDS"]

# the widths and counts of a decoder's weights: each is some dimension of some tensor
SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "head_dim", "vocab_size",
    "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
)  # fmt: skip
_ACTIVATIONS = ("hidden_act", "hidden_activation", "activation_function")
_HINT = "fix config.json: it must describe the weights beside it"


def _config_file(checkpoint: Checkpoint) -> str:
    folder = checkpoint.path if os.path.isdir(checkpoint.path) else os.path.dirname(os.path.abspath(checkpoint.path))
    return os.path.join(folder, "config.json")


def _refuse(checkpoint: Checkpoint, message: str) -> CheckpointError:
    return CheckpointError(message, path=_config_file(checkpoint), hint=_HINT)


def _shown(value: Any) -> str:
    """A value from config.json as a message quotes it: text raw (the CLI escapes it once), cut."""
    return f"'{value[:80]}'" if isinstance(value, str) else repr(value)[:80]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_count(names) -> int:
    """Decoder layers in the checkpoint: one more than the highest layer index in its names."""
    from qtool.weight_position import weight_position

    highest = -1
    for name in names:
        layer = weight_position(name).layer
        if layer is not None and layer > highest:
            highest = layer
    return highest + 1


def check_config(checkpoint: Checkpoint, raw: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The checks above, on config.json's fields `raw` (model_type and quantization_config
    aside), before transformers sees them; `shapes`: the checkpoint's weights by name (stored
    tensors, or a quantized checkpoint's logical weights)."""
    widest = max((int(d) for shape in shapes.values() for d in shape), default=0)
    for field in SIZE_FIELDS:
        value = raw.get(field)
        if value is None:
            continue
        if not _whole(value) or not 1 <= value <= widest:
            raise _refuse(
                checkpoint,
                f"{field} is {_shown(value)}, not a whole number from 1 to {widest} (the largest dimension of any weight in the checkpoint)",
            )
    layers = raw.get("num_hidden_layers")
    present = _layer_count(shapes)
    if layers is not None and (not _whole(layers) or not 1 <= layers <= max(present, 1)):
        raise _refuse(
            checkpoint, f"num_hidden_layers is {_shown(layers)}, but the checkpoint holds {present} decoder layers"
        )
    _check_names(checkpoint, raw)


def _check_names(checkpoint: Checkpoint, raw: Mapping[str, Any]) -> None:
    from transformers.activations import ACT2FN
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for field in _ACTIVATIONS:
        value = raw.get(field)
        if value is not None and (not isinstance(value, str) or value not in ACT2FN):
            raise _refuse(checkpoint, f"{field} is {_shown(value)}, not an activation transformers has")
    known = {"default", *ROPE_INIT_FUNCTIONS}
    for field in ("rope_scaling", "rope_parameters"):
        value = raw.get(field)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise _refuse(checkpoint, f"{field} is {_shown(value)}, not an object")
        nested = [v for v in value.values() if isinstance(v, Mapping)]  # per layer type: {"full_attention": {...}, ...}
        for entry in nested if nested and len(nested) == len(value) else [value]:
            kind = entry.get("rope_type", entry.get("type"))
            if kind is not None and (not isinstance(kind, str) or kind not in known):
                raise _refuse(
                    checkpoint, f"{field} names rope_type {_shown(kind)}, not one of {', '.join(sorted(known))}"
                )


def check_shapes(
    checkpoint: Checkpoint, model: Any, layers_prefix: str, model_type: str, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """The skeleton (on meta) against the checkpoint's weights `shapes`: each decoder layer
    parameter present with its shape, any other parameter the checkpoint names with its shape."""
    layers = layers_prefix + "."
    for name, param in model.named_parameters():
        shape = shapes.get(name)
        if shape is None:
            if name.startswith(layers):
                raise _refuse(
                    checkpoint, f"the {model_type} architecture it describes has {name}, which the checkpoint lacks"
                )
            continue
        if tuple(int(d) for d in shape) != tuple(param.shape):
            raise _refuse(
                checkpoint,
                f"the {model_type} architecture it describes has {name} of shape {list(param.shape)}, the checkpoint {list(shape)}",
            )
