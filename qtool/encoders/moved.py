"""A quantized weight's own codes written into another toolchain's tensors (`qtool.plan.Moved`,
`qtool convert`): the convention's `IntCodes` in, the target's tensors out by the plan's mover
(`qtool.layouts.moves`), which refuses a move that would not be exact. The weight's error is then
measured as every encoder's is: the written tensors decoded by qtool's reader of the target
against the source's own dequantization, so an exact move reports exact (noise 0), checked,
not assumed."""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Iterator

from qtool.buffers import tensor_bytes
from qtool.error_measures import ErrorStats
from qtool.errors import InternalError, SchemeError
from qtool.plan import Job, Moved, Piece

if TYPE_CHECKING:
    import torch

    from qtool.weight_codes import IntCodes

__all__ = ["MovedEncoder", "row_order"]

_HINT = "convert to a target whose grid holds these codes (--to compressed-tensors or another GGUF type)"


def row_order(transform, rows: int) -> torch.Tensor:
    """The index a row transform (a GGUF llama's q/k permutation, `RotaryRows`) amounts to:
    `new[r] = old[index[r]]`, for `IntCodes.take_rows`."""
    import torch

    return transform.apply(torch.arange(rows), rows)


class MovedEncoder:
    takes = "codes"

    def __init__(self, layout, job: Job, measure: bool) -> None:
        self.layout, self.job = layout, job
        self.errors: ErrorStats | None = ErrorStats() if measure else None

    def encode(self, codes: IntCodes) -> Iterator[Piece]:
        job = self.job
        encoding = job.encoding
        if not isinstance(encoding, Moved) or job.scheme is None:
            raise InternalError(f"{job.weight.name}: a moved job without its target or scheme")
        if job.transform is not None:
            codes = codes.take_rows(row_order(job.transform, int(codes.shape[0])))
        source = codes.dequantized()
        moved = encoding.mover.move(job.weight.name, codes)
        if isinstance(moved, str):
            raise SchemeError(f"{job.weight.name}: cannot move exactly to {encoding.mover.target}: {moved}", hint=_HINT)
        if isinstance(moved, tuple):
            yield from self._tensors(source, *moved)
        else:
            yield from self._blocks(source, moved, encoding.mover.target)

    def _tensors(self, source, scheme, tensors: dict) -> Iterator[Piece]:
        """A safetensors layout's tensors, measured as the layout's reader decodes them."""
        job = self.job
        planned = {t.name: t for t in job.outputs}
        if set(tensors) != set(planned):
            raise InternalError(
                f"{job.weight.name}: moved tensors {sorted(tensors)} are not the planned {sorted(planned)}"
            )
        if self.errors is not None:
            dtype = job.encoding.mover.model_dtype
            written = self.layout.reconstruct(job.weight.name, tensors, scheme, tuple(job.weight.shape), dtype)
            self.errors.update(source, written.float().to(source.device))
        for name, tensor in tensors.items():
            data = tensor_bytes(tensor.contiguous().cpu())
            if data.nbytes != planned[name].nbytes:
                raise InternalError(f"{name}: {data.nbytes} moved bytes, {planned[name].nbytes} planned")
            yield name, data, 0

    def _blocks(self, source, moved: bytes, target: str) -> Iterator[Piece]:
        """GGUF blocks, measured as qtool's GGUF decoder (gguf-py's, bit for bit) reads them."""
        import torch

        from qtool.conventions.gguf import decode_blocks

        job = self.job
        out = job.outputs[0]
        if len(moved) != out.nbytes:
            raise InternalError(f"{out.name}: {len(moved)} moved bytes, {out.nbytes} planned")
        if self.errors is not None:
            raw = torch.frombuffer(bytearray(moved), dtype=torch.uint8)
            self.errors.update(source, decode_blocks(raw, target, tuple(job.weight.shape), name=job.weight.name))
        yield out.name, memoryview(moved), 0
