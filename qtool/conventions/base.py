"""What conventions share: grouping tensors by module, plain weights, and reading a block
shape back from a scale's shape."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Protocol

from qtool.formats.checkpoint import Checkpoint, StoredTensor
from qtool.formats.untrusted_json import describe, parse_json, side_file_path
from qtool.weight import Weight

if TYPE_CHECKING:
    from qtool.scheme import Block

__all__ = [
    "Convention",
    "Pool",
    "by_module",
    "plain_weight",
    "plain_weights",
    "block_from_scale",
    "infer_block_size",
    "side_file",
    "metadata_json",
    "unusable_scale",
    "unusable_zero_point",
    "require_convention",
]

Pool = dict[str, StoredTensor]  # tensors no convention has claimed yet


class Convention(Protocol):
    name: str

    def detect(self, checkpoint: Checkpoint, pool: Pool) -> list[Weight]:
        """Return the weights this convention claims. Members must come from `pool`."""
        ...


def side_file(checkpoint: Checkpoint, name: str = "config.json") -> str:
    """The path of the side file `name` that `checkpoint.side_files[name]` was read from: what
    a message about one of its fields names."""
    return side_file_path(checkpoint.path, name)


def metadata_json(checkpoint: Checkpoint, key: str) -> Any:
    """The JSON a container's metadata string `key` holds (safetensors `__metadata__`), parsed
    with qtool.formats.untrusted_json's limits; None when the key is absent or not a string."""
    raw = checkpoint.metadata.get(key)
    if not isinstance(raw, str):
        return None
    return parse_json(
        raw,
        checkpoint.path,
        where=f"__metadata__[{describe(key, 80)}]",
        hint="the file's metadata is damaged; re-save the checkpoint",
    )


def unusable_scale(tensor: StoredTensor, label: str) -> str | None:
    """Why `tensor` cannot be a scale, or None: the kernels take float scales with a torch dtype
    and U8/F8_E8M0 (E8M0) ones; a sub-byte float (F4, F6_*) is only raw bytes to torch, and an
    integer scale is no toolchain's. `label` names it in the reason ("weight_scale")."""
    dtype = tensor.dtype
    if dtype.name in ("U8", "F8_E8M0") or (dtype.kind == "float" and dtype.torch_name is not None):
        return None
    return f"{label} is {dtype.name}, which no toolchain stores scales as (a float, or U8/F8_E8M0 for E8M0)"


def unusable_zero_point(tensor: StoredTensor, label: str) -> str | None:
    """Why `tensor` cannot be a zero point, or None: an integer or a float with a torch dtype."""
    dtype = tensor.dtype
    if dtype.kind in ("int", "uint", "float") and dtype.torch_name is not None:
        return None
    return f"{label} is {dtype.name}, which no toolchain stores zero points as (an integer or a float)"


def require_convention(weight: Weight, name: str) -> None:
    """A decoder handed another convention's weight is a bug in its caller (exit 70), never in
    the file: `decoder_for` picks the decoder by the weight's own convention."""
    if weight.convention != name:
        from qtool.errors import InternalError

        raise InternalError(f"the {name} decoder was handed {weight.name}, a {weight.convention} weight")


def by_module(pool: Pool) -> dict[str, dict[str, StoredTensor]]:
    """`model.layers.0.q_proj.weight_scale` -> {"model.layers.0.q_proj": {"weight_scale": ...}}."""
    modules: dict[str, dict[str, StoredTensor]] = defaultdict(dict)
    for name, tensor in pool.items():
        module, _, leaf = name.rpartition(".")
        modules[module][leaf] = tensor
    return modules


def plain_weight(tensor: StoredTensor, note: str | None = None) -> Weight:
    return Weight.plain(tensor, [note] if note else [])


def plain_weights(tensors: dict[str, StoredTensor], note: str) -> list[Weight]:
    """A half-recognized layout: each tensor stays plain, with a note saying why."""
    return [plain_weight(tensor, note) for tensor in tensors.values()]


def infer_block_size(dim: int, count: int, hint: int | None = None) -> int | None:
    """The block size along a dim of `dim` elements that yields `count` blocks.

    Several sizes can give the same count when the last block is partial, so prefer the
    config's `hint`, then a power of two (what every toolchain uses), then an exact division.
    """
    if count < 1 or dim < 1:
        return None
    if hint and math.ceil(dim / hint) == count:
        return hint
    size = 1
    while size <= dim:
        if math.ceil(dim / size) == count:
            return size
        size *= 2
    if dim % count == 0:
        return dim // count
    return None


def block_from_scale(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], hint: tuple[int, int] | None = None
) -> Block | None:
    """The block shape under which a `[O, I]` weight has a scale of `scale_shape`, or None.

    ()/(1,)/(1, 1) is per-tensor; (O,)/(O, 1) per-channel; (O, G) per-group; else 2-D blocks.
    """
    # here, not at the top: a plain checkpoint never needs qtool.scheme
    from qtool.scheme import CHANNEL, TENSOR

    if len(shape) != 2:
        return None
    rows, cols = shape
    if hint:  # the config's block, when the scale's shape fits it (g128 on 128 inputs is one group)
        hint_rows, hint_cols = hint
        grid = (math.ceil(rows / hint_rows), math.ceil(cols / hint_cols))
        if tuple(scale_shape) == grid or (len(scale_shape) == 1 and grid[1] == 1 and scale_shape[0] == grid[0]):
            return (1, hint_cols) if hint_rows == 1 else (hint_rows, hint_cols)
    if math.prod(scale_shape) == 1 and len(scale_shape) <= 2:
        return TENSOR
    if scale_shape in ((rows,), (rows, 1)):
        return CHANNEL
    if len(scale_shape) != 2:
        return None
    scale_rows, scale_cols = scale_shape
    hint_rows, hint_cols = hint if hint else (None, None)
    block_cols = infer_block_size(cols, scale_cols, hint_cols)
    if block_cols is None:
        return None
    if scale_rows == rows:
        return (1, block_cols)
    block_rows = infer_block_size(rows, scale_rows, hint_rows)
    if block_rows is None:
        return None
    return (block_rows, block_cols)
