"""The one-run true-sequential pass (qtool.calibration.true_sequential) on toy layers: each
Linear is quantized once every pass that will reach it waits there, on the inputs the Linears
quantized before it give; a Linear only some samples reach (a routed expert) waits for those
only; a layer that calls a Linear twice or out of order is found beforehand and, in the pass,
refused; an error in one pass leaves no pass and no hook behind."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("greenlet")

from qtool.calibration import true_sequential  # noqa: E402


class Toy(torch.nn.Module):
    """a -> b (with `route`, only for samples whose input sums above 0) -> c, or the Linears
    named in `calls` in that order; `never` is not called."""

    def __init__(self, calls=("a", "b", "c"), route=True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.never = (torch.nn.Linear(4, 4, bias=False) for _ in range(4))
        self.calls, self.route = calls, route

    def forward(self, x):
        routed = float(x.sum()) > 0 or not self.route
        for name in self.calls:
            if name != "b" or routed:
                x = getattr(self, name)(x)
        return (x,)


def linears(toy, names=("a", "b", "c", "never")):
    return {name: getattr(toy, name) for name in names}


def halve(toy, seen):
    def quantize(name, inputs):
        seen.append((name, [x.clone() for x in inputs]))
        getattr(toy, name).weight.data.mul_(0.5)

    return quantize


def samples():
    """[4 samples, 3 tokens, 4]; sample 1 is not routed through b, sample 2 is."""
    hidden = torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1))
    hidden[1] = -hidden[1].abs()
    hidden[2] = hidden[2].abs()
    return hidden


def test_each_linear_is_quantized_on_the_inputs_its_quantized_predecessors_give():
    toy, hidden = Toy(), samples()
    float_toy = Toy()
    seen = []
    inputs = hidden.clone()
    done = true_sequential.run(toy, hidden, {}, linears(toy), halve(toy, seen))
    assert done == ["a", "b", "c"] and [name for name, _ in seen] == done
    routed = [index for index in range(4) if float(inputs[index].sum()) > 0]
    assert 1 not in routed and 2 in routed
    a, b, c = (float_toy.a.weight * 0.5, float_toy.b.weight * 0.5, float_toy.c.weight * 0.5)
    with torch.no_grad():
        after_a = [x @ a.T for x in inputs]
        after_b = [after_a[i] @ b.T if i in routed else after_a[i] for i in range(4)]
        torch.testing.assert_close(torch.cat(seen[0][1]), inputs)  # a: the layer's inputs
        torch.testing.assert_close(torch.cat(seen[1][1]), torch.stack([after_a[i] for i in routed]))  # b: the routed samples only, through a as quantized
        torch.testing.assert_close(torch.cat(seen[2][1]), torch.stack(after_b))  # c: through a and b as quantized
        torch.testing.assert_close(hidden, torch.stack([x @ c.T for x in after_b]))  # the outputs over the inputs


@pytest.mark.parametrize(
    "calls, route, names, expected",
    [
        (("a", "b", "c"), True, ("a", "b", "c", "never"), ["a", "b", "c", "never"]),  # the modules' order; b for some samples only
        (("a", "b", "a"), True, ("a", "b", "c", "never"), None),  # a twice
        (("c", "a", "b"), False, ("a", "b", "c"), ["c", "a", "b"]),  # every sample calls all three, in another order
        (("c", "a", "b"), True, ("a", "b", "c"), None),  # ... but not the same: b for some only
        (("c", "a", "b"), False, ("a", "b", "c", "never"), None),  # ... and one never
    ],
)  # fmt: skip
def test_the_order_comes_from_a_float_run_of_the_layer(calls, route, names, expected):
    hidden = samples()
    toy = Toy(calls, route)
    out = torch.empty_like(hidden)
    assert true_sequential.order(toy, hidden, {}, linears(toy, names), out) == expected
    with torch.no_grad():
        torch.testing.assert_close(out, torch.stack([toy(x.unsqueeze(0))[0][0] for x in hidden]))
    assert not any(getattr(toy, name)._forward_pre_hooks for name in linears(toy))


def test_a_linear_called_after_it_was_quantized_is_refused():
    toy = Toy(("a", "c", "a"))
    with pytest.raises(true_sequential.OutOfOrder, match="called a again"):
        true_sequential.run(toy, samples(), {}, linears(toy), halve(toy, []))
    assert not any(getattr(toy, name)._forward_pre_hooks for name in linears(toy))


def test_an_error_in_one_pass_unwinds_the_others_and_removes_the_hooks():
    toy = Toy()
    unwound = []

    def quantize(name, inputs):
        if name == "b":
            raise ValueError("no")

    original = toy.forward

    def forward(x):
        try:
            return original(x)
        except BaseException as error:
            unwound.append(type(error).__name__)
            raise

    toy.forward = forward
    with pytest.raises(ValueError, match="no"):
        true_sequential.run(toy, samples(), {}, linears(toy), quantize)
    assert unwound == ["GreenletExit"] * 4, unwound  # every pass was waiting, at b or (not routed) at c
    assert not any(getattr(toy, name)._forward_pre_hooks for name in linears(toy))
