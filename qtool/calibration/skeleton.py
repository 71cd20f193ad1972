"""The model's structure from transformers, its weights from qtool's readers.

`Skeleton.build` makes the architecture's causal LM on the `meta` device from config.json (no
weight allocated; the config checked against the checkpoint before and after,
`qtool.calibration.config_check`; the folder's own code never trusted,
`qtool.formats.transformers_boundary`) and finds its stack of decoder layers: one `nn.ModuleList` of
`num_hidden_layers` modules of one class, their fused mixture-of-experts weights replaced by
one Linear per expert (`qtool.calibration.experts`). `materialize(module, prefix)` gives one part real
tensors on the device, read from the checkpoint by name when its turn comes; `release` sends it
back to `meta`, so one layer is in memory at a time. Buffers transformers computes at init
(rotary frequencies) are rebuilt by constructing that module again from the config.

Calibration reads float weights only. Evaluation (`qtool.evaluation`) builds the skeleton of a
quantized checkpoint from its logical weights' shapes (`shapes`) and gives it a `reader` that
decodes each weight when its turn comes, in the compute `dtype` it asks for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from qtool.errors import CheckpointError, UsageError
from qtool.message_text import excerpt

if TYPE_CHECKING:
    import torch

    from qtool.formats.checkpoint import Checkpoint
    from qtool.weight import Weight

__all__ = ["Skeleton", "import_transformers_lean", "LEFT_OUT"]

# packages transformers imports at its own import when they are installed, for integrations a
# calibrated run never uses (torchao's and HQQ's quantizers and caches, the `kernels` hub, scipy
# for its object-detection losses): 0.09 GB of a run's peak RSS in a venv that has them
LEFT_OUT = ("torchao", "hqq", "kernels", "scipy")


def import_transformers_lean() -> None:
    """Import transformers (its modeling core) with the `LEFT_OUT` packages hidden, so that it
    takes them for not installed: transformers records that once per process (cached), so its
    integrations with them stay off in this process. For a process qtool owns (the CLI's
    calibrated commands); nothing happens once transformers is imported, or where it is not
    installed. The packages are importable again afterwards."""
    import sys

    if "transformers" in sys.modules:
        return
    hidden = [name for name in LEFT_OUT if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # importlib's find_spec: not installed
    try:
        import transformers.modeling_utils  # noqa: F401
    except ImportError:
        pass  # said in one line where calibration needs it
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _config(checkpoint: Checkpoint, notes: list[str], shapes: Mapping[str, tuple[int, ...]]):
    """transformers' config of the checkpoint, from config.json checked first
    (`qtool.calibration.config_check`): a folder that names its own code for an architecture
    transformers lacks is refused (`qtool.formats.transformers_boundary`), never run."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from qtool.calibration.config_check import check_config
    from qtool.formats.transformers_boundary import collected, refuse_folder_code

    raw = dict(checkpoint.config)
    model_type = raw.pop("model_type", None)
    folder = checkpoint.path if os.path.isdir(checkpoint.path) else os.path.dirname(os.path.abspath(checkpoint.path))
    refuse_folder_code(folder, raw, known_model_type=isinstance(model_type, str) and model_type in CONFIG_MAPPING)
    if not isinstance(model_type, str):
        raise UsageError(
            f"{checkpoint.path}: config.json names no model_type, so transformers cannot build the model",
            option="calibrate",
        )
    if model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"{checkpoint.path}: architecture {model_type!r} is not known to this transformers", option="calibrate"
        )
    raw.pop("quantization_config", None)
    raw.pop("auto_map", None)  # a known architecture: transformers' own classes, never the folder's
    check_config(checkpoint, raw, shapes)
    try:
        with collected(notes, "transformers: "):
            config = AutoConfig.for_model(model_type, **raw)
    except Exception as exc:  # a config transformers rejects (a bad field, a bad value)
        raise _refused(checkpoint, f"transformers' {model_type} config", exc) from None
    config._attn_implementation = "sdpa"
    return config


def _refused(checkpoint: Checkpoint, by: str, exc: BaseException) -> CheckpointError:
    """config.json refused `by` transformers' config or model classes, in one line."""
    return CheckpointError(
        f"config.json is refused by {by}: {type(exc).__name__}: {excerpt(' '.join(str(exc).split()))}",
        path=checkpoint.path,
    )


@dataclass
class Skeleton:
    model: Any  # the causal LM, on meta until a part is materialized
    config: Any
    base: Any  # the module whose forward embeds and runs the layers (LlamaModel, ...)
    base_prefix: str  # its name in the checkpoint ("model")
    layers: Any  # the nn.ModuleList of decoder layers
    layers_prefix: str  # "model.layers"
    moe: list  # per layer, its mixture-of-experts blocks (qtool.calibration.experts.MoeBlock), unfused

    notes: list = field(
        default_factory=list
    )  # transformers' and torch's talk while it was built, for the user's warnings
    # evaluation's: a weight (quantized or not) to its float values on the device, in its
    # logical shape; None: the stored float bytes, and a quantized weight refused
    reader: Callable[[Weight, Checkpoint, str], torch.Tensor] | None = None
    dtype: str = "float32"  # the parameters' dtype once materialized (torch's name)

    @classmethod
    def build(cls, checkpoint: Checkpoint, shapes: Mapping[str, tuple[int, ...]] | None = None) -> Skeleton:
        """The skeleton, config.json checked against the checkpoint before and after it is built
        (`qtool.calibration.config_check`), remote code never trusted, whatever transformers
        logs or warns kept in `notes`. `shapes`: the weights by name that the checks and the
        experts' names see (default: the stored tensors'; evaluation's: the logical weights')."""
        import torch
        from transformers import AutoModelForCausalLM

        from qtool.calibration.config_check import check_shapes
        from qtool.formats.transformers_boundary import TRUST, collected

        if shapes is None:
            shapes = {name: tensor.shape for name, tensor in checkpoint.tensors.items()}
        notes: list[str] = []
        config = _config(checkpoint, notes, shapes)
        model = None
        for attention in ("sdpa", "eager"):  # eager: an architecture without SDPA attention (Gemma 2)
            config._attn_implementation = attention
            try:
                with collected(notes, "transformers: "), torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, trust_remote_code=TRUST)
                break
            except ValueError:
                continue
            except Exception as exc:  # a value transformers' modules cannot be built from
                raise _refused(checkpoint, f"transformers' {config.model_type} model", exc) from None
        if model is None:
            raise UsageError(
                f"{checkpoint.path}: transformers has no causal LM for architecture {config.model_type!r}",
                option="calibrate",
            )
        count = getattr(config, "num_hidden_layers", None)
        found = None
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) == count and len({type(m) for m in module}) == 1:
                found = (name, module)
                break
        if found is None:
            raise UsageError(
                f"{checkpoint.path}: architecture {config.model_type!r} is not a stack of {count} decoder layers of one class",
                option="calibrate",
            )
        layers_prefix, layers = found
        from qtool.calibration.experts import unfuse

        names = list(shapes)
        moe = [unfuse(layer, f"{layers_prefix}.{index}", names, checkpoint.path) for index, layer in enumerate(layers)]
        check_shapes(checkpoint, model, layers_prefix, config.model_type, shapes)
        base_prefix = layers_prefix.rpartition(".")[0]
        base = model.get_submodule(base_prefix) if base_prefix else model
        return cls(model, config, base, base_prefix, layers, layers_prefix, moe, notes)

    def materialize(
        self,
        module,
        prefix: str,
        weights: dict[str, Weight],
        checkpoint: Checkpoint,
        device: str,
        *,
        skip: tuple[str, ...] = (),
    ) -> None:
        """Give `module` (named `prefix` in the checkpoint) real float32 tensors on `device`,
        read by name; the submodules named in `skip` stay on meta. A parameter the checkpoint
        lacks is a one-line error."""
        for name, child in list(module.named_children()):
            if name in skip:
                continue
            self._materialize_tree(child, f"{prefix}.{name}" if prefix else name, weights, checkpoint, device)
        for name, _ in list(module.named_parameters(recurse=False)):
            self._load(module, name, f"{prefix}.{name}" if prefix else name, weights, checkpoint, device)

    def input_embedding(self) -> tuple[str, Any] | None:
        """(its name in the base, the module) of the token embedding, when it is an
        `nn.Embedding` (or a subclass, such as Gemma 3's scaled one) directly under the base
        model with a 2-D weight and nothing else to read; else None (read whole)."""
        import torch

        try:
            embedding = self.base.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            return None
        if (
            not isinstance(embedding, torch.nn.Embedding)
            or [n for n, _ in embedding.named_parameters()] != ["weight"]
            or any(True for _ in embedding.children())
        ):
            return None
        return next(((name, child) for name, child in self.base.named_children() if child is embedding), None)

    def materialize_rows(
        self, module, prefix: str, rows: torch.Tensor, weights: dict[str, Weight], checkpoint: Checkpoint, device: str
    ):
        """The embedding `module` with only the rows `rows` (sorted distinct token ids) of its
        weight, float32, read row range by row range: row i of the result is token rows[i], so
        the caller renumbers its ids with `torch.unique(..., return_inverse=True)`. A whole
        vocabulary (49152 x 576 float32 in SmolLM2: 113 MB) is never in memory for the few
        thousand distinct tokens of the samples. Returns a function that puts back what it
        changed (the padding index, which `F.embedding` checks against the row count, and the
        weight's own shape)."""
        import torch

        from qtool.buffers import tensor_from_bytes

        full = f"{prefix}.weight"
        weight = weights.get(full)
        if weight is None:
            raise CheckpointError(
                f"has no tensor {full}, which the {self.config.model_type} architecture needs", path=checkpoint.path
            )
        param = module._parameters["weight"]
        if tuple(weight.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{full} has shape {list(weight.shape)}, the {self.config.model_type} architecture expects {list(param.shape)}",
                path=checkpoint.path,
            )
        buffers = dict(module.named_buffers(recurse=False))
        if any(b.is_meta for b in buffers.values()):
            self._initialize_buffers(module, device)
        padding_idx = module.padding_idx
        module.padding_idx = None

        def restore() -> None:  # the whole vocabulary's shape back (on meta), for the next embedding
            module.padding_idx = padding_idx
            module._parameters["weight"] = param

        if self.reader is not None:  # decoded whole, then the rows taken
            values = self.reader(weight, checkpoint, device)[rows.to(device)].to(getattr(torch, self.dtype))
            module._parameters["weight"] = torch.nn.Parameter(values, requires_grad=False)
            return restore
        if weight.quantized:
            raise UsageError(
                f"{checkpoint.path} is already quantized ({full}); calibration needs float weights", option="calibrate"
            )
        width = int(param.shape[1])
        row_bytes = weight.data.nbytes // int(param.shape[0])
        ids = rows.tolist()
        values = torch.empty((len(ids), width), dtype=torch.float32, device=device)
        start = 0
        while start < len(ids):  # runs of consecutive ids: one read each
            end = start + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1:
                end += 1
            raw = checkpoint.read_bytes(weight.data, ids[start] * row_bytes, (end - start) * row_bytes)
            values[start:end] = tensor_from_bytes(raw, weight.data.dtype, (end - start, width)).to(
                device=device, dtype=torch.float32
            )
            start = end
        module._parameters["weight"] = torch.nn.Parameter(values, requires_grad=False)
        return restore

    def _materialize_tree(self, module, prefix: str, weights, checkpoint, device: str) -> None:
        buffers = dict(module.named_buffers(recurse=False))
        if any(b.is_meta for b in buffers.values()):
            if any(True for _ in module.parameters(recurse=False)):
                self._initialize_buffers(module, device)
            else:
                self._rebuild(module, prefix, device)
        for name, child in list(module.named_children()):
            self._materialize_tree(child, f"{prefix}.{name}", weights, checkpoint, device)
        for name, _ in list(module.named_parameters(recurse=False)):
            self._load(module, name, f"{prefix}.{name}", weights, checkpoint, device)

    def _rebuild(self, module, prefix: str, device: str) -> None:
        """A parameterless module with computed buffers (rotary frequencies): built again from
        the config on the device."""
        import torch

        try:
            with torch.device(device):
                fresh = type(module)(config=self.config)
        except TypeError:
            raise UsageError(
                f"{prefix}: qtool cannot rebuild {type(module).__name__} outside transformers' loader",
                option="calibrate",
            ) from None
        for name, buffer in fresh.named_buffers(recurse=False):
            module._buffers[name] = buffer

    def _initialize_buffers(self, module, device: str) -> None:
        """Computed buffers of a module with weights (Gemma 3's embedding scale): allocated, then
        set by the architecture's own `_init_weights`, as transformers' loader does; the weights
        stay on meta until they are read, so initializing them costs nothing."""
        import torch

        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            self.model._init_weights(module)

    def _load(
        self, module, name: str, full: str, weights: dict[str, Weight], checkpoint: Checkpoint, device: str
    ) -> None:
        import torch

        from qtool.buffers import tensor_from_bytes

        weight = weights.get(full)
        if weight is None:
            raise CheckpointError(
                f"has no tensor {full}, which the {self.config.model_type} architecture needs", path=checkpoint.path
            )
        param = module._parameters[name]
        if tuple(weight.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{full} has shape {list(weight.shape)}, the {self.config.model_type} architecture expects {list(param.shape)}",
                path=checkpoint.path,
            )
        if self.reader is not None:
            values = self.reader(weight, checkpoint, device)
        elif weight.quantized:
            raise UsageError(
                f"{checkpoint.path} is already quantized ({full}); calibration needs float weights", option="calibrate"
            )
        else:
            values = tensor_from_bytes(checkpoint.read_bytes(weight.data), weight.data.dtype, tuple(weight.data.shape))
        module._parameters[name] = torch.nn.Parameter(
            values.to(device=device, dtype=getattr(torch, self.dtype)), requires_grad=False
        )

    @staticmethod
    def release(module) -> None:
        """Back to meta: the tensors are freed."""
        module.to("meta")
