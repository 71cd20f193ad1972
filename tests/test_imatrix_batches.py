"""`qtool imatrix` runs each decoder layer over a batch of chunks at once (issue 42 #16:
llama-imatrix's time), and the matrix it writes is the one a chunk-at-a-time run writes, byte
for byte: each chunk's float32 sums are its own, added in chunk order. A mixture of experts,
whose experts see their routed tokens, not [chunks, chunk size, columns], runs a chunk at a
time."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.test_calibration_runner import TINY, calibrate_plan, text_file  # noqa: E402


def _collect(model, tmp_path, monkeypatch, *, chunk_at_a_time: bool):
    """The statistics of `model` on 4 chunks of 32 tokens, and the decoder layers' forward calls."""
    from qtool.calibration import imatrix, layers
    from qtool.calibration.skeleton import Skeleton

    if chunk_at_a_time:
        monkeypatch.setattr(layers, "BATCH_VALUES", 1)
    plan = calibrate_plan(model, tmp_path / f"out-{chunk_at_a_time}", text_file(tmp_path), samples=4, seq_len=32)
    calls: list[tuple[int, int]] = []
    try:
        skeleton = Skeleton.build(plan.source)
        for index, layer in enumerate(skeleton.layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: calls.append((index, args[0].shape[0])))
        stats = imatrix.collect_imatrix(
            plan.source, [j.weight for j in plan.jobs], lambda name: name, plan.calibration.tokens, skeleton=skeleton
        )
    finally:
        plan.source.close()
    monkeypatch.undo()
    return stats, calls


def _same(batched, alone) -> None:
    assert list(batched.sums) == list(alone.sums) and batched.sums
    for name in alone.sums:
        assert batched.sums[name].dtype == alone.sums[name].dtype
        assert batched.sums[name].tobytes() == alone.sums[name].tobytes(), name
        assert batched.counts[name] == alone.counts[name], name
        assert ".experts." in name or alone.counts[name] == 4 * 32, name  # an expert: its routed tokens


def test_each_layer_runs_once_over_all_chunks_with_the_sums_of_a_chunk_at_a_time(tmp_path, monkeypatch):
    batched, calls = _collect(TINY, tmp_path, monkeypatch, chunk_at_a_time=False)
    alone, calls_alone = _collect(TINY, tmp_path, monkeypatch, chunk_at_a_time=True)
    assert calls == [(0, 4), (1, 4)]
    assert calls_alone == [(0, 1)] * 4 + [(1, 1)] * 4
    _same(batched, alone)


def test_a_mixture_of_experts_runs_a_chunk_at_a_time_with_the_same_sums(tmp_path, monkeypatch):
    from tests.test_calibration_moe import tiny_moe

    model = tiny_moe(tmp_path / "moe", "mixtral", dtype=torch.float32)
    batched, calls = _collect(model, tmp_path, monkeypatch, chunk_at_a_time=False)
    alone, _ = _collect(model, tmp_path, monkeypatch, chunk_at_a_time=True)
    # the first layer's batch stops at its first expert; that layer and the next: a chunk at a time
    assert calls == [(0, 4)] + [(0, 1)] * 4 + [(1, 1)] * 4
    assert any(".experts." in name for name in alone.sums)
    _same(batched, alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunks_float32_sum_alone_equals_its_row_of_the_batchs(threads):
    """What the byte-for-byte claim rests on: torch's sum over a chunk's tokens, [tokens,
    columns].sum(0), gives the same float32 bits as that chunk's row of the batch's
    [chunks, tokens, columns].sum(1), on odd and even shapes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for chunks, tokens, columns in [(1, 512, 576), (8, 512, 576), (3, 100, 7), (5, 512, 1536), (2, 1000, 1000)]:
            x = (
                torch.randn(chunks, tokens, columns, generator=generator)
                * torch.rand(columns, generator=generator)
                * 10
            )
            batch = x.square().sum(dim=1)
            for index in range(chunks):
                alone = x[index].reshape(-1, columns).float().square().sum(dim=0)
                assert torch.equal(batch[index], alone), (chunks, tokens, columns, index)
    finally:
        torch.set_num_threads(before)


def test_a_batch_is_as_many_chunks_as_the_activation_budget_holds():
    from qtool.calibration.layers import BATCH_VALUES, per_batch as chunks_per_batch

    assert chunks_per_batch(8, 512, 4608) == 8  # SmolLM2-135M: 9 heads x 512, all 8 chunks at once
    assert chunks_per_batch(100, 512, 32 * 512) == BATCH_VALUES // (512 * 32 * 512) == 4
    assert chunks_per_batch(3, 1 << 20, 1 << 20) == 1  # never fewer than one
    assert np.all([chunks_per_batch(n, 16, 1) == n for n in (1, 2, 7)])
