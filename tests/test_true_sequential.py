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
    def quantize(names, inputs):
        for name in names:
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
        torch.testing.assert_close(
            torch.cat(seen[1][1]), torch.stack([after_a[i] for i in routed])
        )  # b: the routed samples only, through a as quantized
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
    found = true_sequential.order(toy, hidden, {}, linears(toy, names), out)
    assert (found and found.names) == expected
    assert not (found and found.followers)  # each Linear reads the one before's output
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

    def quantize(names, inputs):
        if names == ["b"]:
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


class Widening(torch.nn.Module):
    """a widens (4 -> 12), b narrows back: b's input is larger than a sample, as a down_proj's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b = torch.nn.Linear(4, 12, bias=False), torch.nn.Linear(12, 4, bias=False)

    def forward(self, x):
        return (self.b(torch.relu(self.a(x))),)


def test_an_input_taken_on_arrival_waits_parked_and_comes_back_whole(monkeypatch):
    """`take` sees each pass's input as it arrives; a taken input's storage is freed while the
    pass waits (the parking file holds it) and restored before the pass goes on, so the outputs
    are those of a run that parks nothing. The samples' buffer, shared by every pass, is never
    parked, though `take` takes a's input (a view of it)."""
    from qtool.calibration.spill import Parking

    monkeypatch.setattr(true_sequential, "PARK_AT_LEAST", 0)  # the toy's tensors are a few bytes

    def calibrate(parking):
        toy, hidden = Widening(), samples()
        arrived: dict[str, list] = {"a": [], "b": []}
        freed_while_waiting = []

        def take(name, x):
            arrived[name].append((x, x.clone()))
            return True

        def quantize(names, inputs):
            assert inputs == []  # every input was taken
            freed_while_waiting.extend(x.untyped_storage().nbytes() == 0 for x, _ in arrived[names[0]])
            getattr(toy, names[0]).weight.data.mul_(0.5)

        done = true_sequential.run(toy, hidden, {}, {"a": toy.a, "b": toy.b}, quantize, take=take, parking=parking)
        assert done == ["a", "b"]
        return hidden, arrived, freed_while_waiting

    parking = Parking()
    try:
        hidden, arrived, freed = calibrate(parking)
    finally:
        parking.close()
    expected, _, kept = calibrate(None)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    assert freed == [False] * 4 + [True] * 4  # a's inputs are views of the samples' buffer; b's were parked
    assert not any(kept)
    for x, copy in arrived["b"]:
        assert torch.equal(x, copy)  # restored, byte for byte


def test_a_parked_storage_comes_back_to_every_view_of_it():
    from qtool.calibration.spill import Parking

    parking = Parking()
    try:
        base = torch.randn(16, 8)
        view, before = base[3:9, 2:], base.clone()
        spot = parking.park(view)
        assert base.untyped_storage().nbytes() == 0
        parking.restore(spot)
        assert torch.equal(base, before) and torch.equal(view, before[3:9, 2:])
        assert parking.park(torch.frombuffer(bytearray(16), dtype=torch.float32)) is None  # memory torch does not own
    finally:
        parking.close()


class Fork(torch.nn.Module):
    """a, then b and c on a's output (as k and v on q's input), then d on their sum; `apart`:
    c reads a copy of that output instead; `skip`: samples whose input sums below 0 skip c."""

    def __init__(self, apart=False, skip=False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c, self.d = (torch.nn.Linear(4, 4, bias=False) for _ in range(4))
        self.apart, self.skip = apart, skip

    def forward(self, x):
        h = self.a(x)
        y = self.b(h)
        if not (self.skip and float(x.sum()) < 0):
            y = y + self.c(h.clone() if self.apart else h)
        return (self.d(y),)


def test_a_linear_on_the_input_of_the_one_before_is_quantized_with_it_without_waiting():
    """c reads the tensor b read, right after b, in every sample: the order marks it b's
    follower; b and c are quantized together on the one set of inputs, and no pass waits at c."""
    toy, hidden = Fork(), samples()
    expected_toy = Fork()
    assert true_sequential.order(
        toy, hidden, {}, linears(toy, "abcd"), torch.empty_like(hidden)
    ) == true_sequential.Order(list("abcd"), frozenset("c"))
    groups, inputs = [], hidden.clone()

    def quantize(names, xs):
        groups.append((names, len(xs)))
        for name in names:
            getattr(toy, name).weight.data.mul_(0.5)

    done = true_sequential.run(toy, hidden, {}, linears(toy, "abcd"), quantize, followers=frozenset("c"))
    assert done == list("abcd") and groups == [(["a"], 4), (["b", "c"], 4), (["d"], 4)]
    for module in (expected_toy.a, expected_toy.b, expected_toy.c, expected_toy.d):
        module.weight.data.mul_(0.5)
    with torch.no_grad():
        torch.testing.assert_close(hidden, torch.stack([expected_toy(x.unsqueeze(0))[0][0] for x in inputs]))


@pytest.mark.parametrize(
    "toy, message",
    [(Fork(apart=True), "called c where c was to follow b"), (Fork(skip=True), "called d where c was to follow b")],
)
def test_a_follower_called_on_another_input_or_not_at_all_is_refused(toy, message):
    """Found on one sample, broken by another: c was quantized on b's inputs, which it did not read."""
    assert true_sequential.order(toy, samples()[2:3], {}, linears(toy, "abcd"), torch.empty(1, 3, 4)).followers == (
        frozenset() if toy.apart else frozenset("c")
    )
    with pytest.raises(true_sequential.OutOfOrder, match=message):
        true_sequential.run(toy, samples(), {}, linears(toy, "abcd"), halve(toy, []), followers=frozenset("c"))
    assert not any(getattr(toy, name)._forward_pre_hooks for name in "abcd")
