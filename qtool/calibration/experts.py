"""Mixture-of-experts layers, unfused for calibration.

transformers 5 keeps a layer's experts fused in 3-D parameters (Mixtral's and Qwen3-MoE's
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]) and fills them from a
checkpoint's per-expert Linears by its conversion mapping. The checkpoints, and the
compressed-tensors layout qtool writes, name one 2-D weight per expert:

    Mixtral     model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight     (gate, up, down)
                model.layers.L.block_sparse_moe.gate.weight                     (the router)
    Qwen-MoE    model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight
                model.layers.L.mlp.gate.weight

and GPTQ needs one Hessian per expert, over the tokens the router sends it. `unfuse` replaces
each fused module by `Experts`: one `Expert` of three `nn.Linear` per expert, named as the
checkpoint names them, computing what the fused forward computes with each expert called on its
routed tokens only; and where the checkpoint names the block otherwise than transformers does
(Mixtral's `block_sparse_moe`, transformers' `mlp`), the layer's module tree takes the
checkpoint's name, so that every module's path is its weights' name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qtool.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["MoeBlock", "unfuse", "fused_experts", "PROJECTIONS"]

# the checkpoints' names for an expert's (gate, up, down) projections: act(gate(x)) * up(x) -> down
PROJECTIONS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class MoeBlock:
    """One layer's mixture-of-experts block, as the runner calibrates it (names relative to
    the decoder layer, as the checkpoint names them)."""

    path: str  # "block_sparse_moe" / "mlp"
    router: str | None  # "block_sparse_moe.gate": its 2-D weight [experts, hidden], or None


def fused_experts(layer) -> list[tuple[str, Any]]:
    """(relative path, module) of each module of `layer` that holds 3-D expert weights."""
    return [
        (name, module)
        for name, module in layer.named_modules()
        if any(p.dim() > 2 for p in module.parameters(recurse=False))
    ]


def _make_classes():
    import torch

    class Expert(torch.nn.Module):
        """One expert's MLP: down(act(gate(x)) * up(x)), its Linears named as the checkpoint names them."""

        def __init__(self, names: tuple[str, str, str], hidden: int, intermediate: int, act) -> None:
            super().__init__()
            self.names = names
            gate, up, down = names
            self.add_module(gate, torch.nn.Linear(hidden, intermediate, bias=False))
            self.add_module(up, torch.nn.Linear(hidden, intermediate, bias=False))
            self.add_module(down, torch.nn.Linear(intermediate, hidden, bias=False))
            self.act = act

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up, down = (self._modules[name] for name in self.names)
            return down(self.act(gate(x)) * up(x))

    class Experts(torch.nn.ModuleList):
        """The fused experts' forward (hidden [tokens, H], top_k_index and top_k_weights
        [tokens, k]) over per-expert modules: expert e sees exactly the tokens routed to it, in
        the fused forward's order (by rank of choice, then token), and adds its weighted output
        to theirs. An expert no token reached is not called."""

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            by_rank = top_k_index.T  # [k, tokens]
            for index, expert in enumerate(self):
                rank, token = torch.where(by_rank == index)
                if token.numel() == 0:
                    continue
                values = expert(hidden_states[token]) * top_k_weights[token, rank, None]
                out.index_add_(0, token, values.to(out.dtype))
            return out

    return Expert, Experts


def _block_names(names, layer_prefix: str) -> dict[str, set[str]]:
    """{block's checkpoint path: the projection names of its expert 0} among `names`."""
    pattern = re.compile(re.escape(layer_prefix) + r"\.([\w.]+?)\.experts\.0\.(\w+)\.weight$")
    found: dict[str, set[str]] = {}
    for name in names:
        match = pattern.match(name)
        if match:
            found.setdefault(match.group(1), set()).add(match.group(2))
    return found


def unfuse(layer, layer_prefix: str, names, where: str) -> list[MoeBlock]:
    """Replace `layer`'s fused experts (on meta) by `Experts` named as the checkpoint's tensor
    `names` name them under `layer_prefix`; the blocks found. A checkpoint that stores its
    experts otherwise (fused 3-D tensors, unknown projection names) is refused in one line."""
    import torch

    fused = fused_experts(layer)
    if not fused:
        return []
    Expert, Experts = _make_classes()
    stored = _block_names(names, layer_prefix)
    blocks = []
    for path, module in fused:
        parent_path, _, attribute = path.rpartition(".")
        shapes = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
        if attribute != "experts" or set(shapes) != {"gate_up_proj", "down_proj"} or not hasattr(module, "act_fn"):
            raise UsageError(
                f"{where}: {type(module).__name__} ({path}) holds its experts in a layout qtool does not unfuse",
                hint="quantize it without calibration text (round to nearest)",
                option="calibrate",
            )
        count, double, hidden = shapes["gate_up_proj"]
        block_path = parent_path if parent_path in stored else (next(iter(stored)) if len(stored) == 1 else None)
        projections = next((p for p in PROJECTIONS if block_path is not None and set(p) == stored[block_path]), None)
        if projections is None:
            raise UsageError(
                f"{where}: the checkpoint names no per-expert 2-D weights for {path} ({layer_prefix}.*.experts.0.{{w1,w3,w2 | gate_proj,up_proj,down_proj}}.weight); "
                "qtool calibrates experts stored one Linear each", hint="quantize it without calibration text (round to nearest)", option="calibrate",
            )  # fmt: skip
        parent = layer.get_submodule(parent_path) if parent_path else layer
        with torch.device("meta"):
            experts = Experts([Expert(projections, hidden, double // 2, module.act_fn) for _ in range(count)])
        parent._modules[attribute] = experts
        router_child = next((name for name, child in parent.named_children() if _is_router(child, count, hidden)), None)
        router = None if router_child is None else f"{block_path}.{router_child}"
        if router_child is not None:
            _register_before(parent, router_child, attribute)
        if block_path != parent_path:
            _rename(layer, parent_path, block_path)
        blocks.append(MoeBlock(block_path, router))
    return blocks


def _is_router(module, count: int, hidden: int) -> bool:
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return weight is not None and tuple(weight.shape) == (count, hidden) and not any(True for _ in module.children())


def _register_before(parent, first: str, then: str) -> None:
    """The child `first` registered just before `then`: the block calls its router before its
    experts, and GPTQ's true-sequential step takes the Linears in their modules' order
    (Qwen3-MoE registers its experts first)."""
    items = [(name, child) for name, child in parent._modules.items() if name != first]
    at = next(index for index, (name, _) in enumerate(items) if name == then)
    items.insert(at, (first, parent._modules[first]))
    parent._modules.clear()
    parent._modules.update(items)


def _rename(layer, old: str, new: str) -> None:
    """The child `old` of `layer` registered as `new` (the checkpoint's name), still reached as
    `layer.<old>` by the layer's forward: the module stays in the instance's attributes, which
    Python looks up before nn.Module's registry. Only a direct child is renamed."""
    if "." in old or "." in new:
        raise UsageError(
            f"the checkpoint names the experts' block {new!r}, the architecture {old!r}; qtool renames a direct child of the layer only",
            option="calibrate",
        )
    module = layer._modules.pop(old)
    layer._modules[new] = module
    object.__setattr__(layer, old, module)
