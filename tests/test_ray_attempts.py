"""Ray's retries counted in the report (issue 42 item 17): `attempts` was 0 under Ray ("not
counted"). Each task attempt checks in with a counting actor before it works, and the driver
reads the count when the result lands. Tested without Ray: a fake `ray` module that runs tasks
in this process and loses the first attempt of one job, as a killed worker would."""

from __future__ import annotations

import types

import pytest

from qtool.spread import ray_executor
from qtool.spread.shard_job import ShardResult


class _Handle:
    def __init__(self, target, options=None):
        self.target, self.options_ = target, options or {}

    def options(self, **options):
        return type(self)(self.target, options)


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeRay:
    """Enough of Ray for `RayCluster`: tasks run at `.remote()`, job `lose` twice (the first
    attempt's worker is lost after it checked in, Ray retries it)."""

    def __init__(self, lose: int | None = None, counting: bool = True):
        self.lose, self.counting, self.calls = lose, counting, []
        self.exceptions = types.SimpleNamespace(
            RayTaskError=type("RayTaskError", (Exception,), {}), WorkerCrashedError=type("W", (Exception,), {}),
            NodeDiedError=type("N", (Exception,), {}), ObjectLostError=type("O", (Exception,), {}), TaskCancelledError=type("T", (Exception,), {}),
        )  # fmt: skip

    def init(self, **_):
        pass

    def shutdown(self):
        pass

    def cluster_resources(self):
        return {"CPU": 2}

    def nodes(self):
        return [{"Alive": True, "Resources": {"CPU": 2}, "NodeID": "n" * 20}]

    def get_runtime_context(self):
        return types.SimpleNamespace(get_node_id=lambda: "node0123456789abcdef")

    def remote(self, *args, **kwargs):
        if not args:  # ray.remote(num_cpus=0)(Class)
            return lambda target: self._remote(target)
        return self._remote(args[0])

    def _remote(self, target):
        fake = self
        if isinstance(target, type):
            if not self.counting:
                raise RuntimeError("no actors on this cluster")

            class ActorClass:
                @staticmethod
                def remote():
                    instance = target()
                    return types.SimpleNamespace(**{
                        name: types.SimpleNamespace(remote=lambda *a, m=getattr(instance, name): _Ref(m(*a)))  # noqa: B008 - bound per name, on purpose
                        for name in ("start", "count")
                    })  # fmt: skip

                @staticmethod
                def options(**_):
                    return ActorClass

            return ActorClass

        class Task(_Handle):
            def remote(self, job, *rest):
                fake.calls.append(job.index)
                if job.index == fake.lose:
                    fake.lose = None
                    try:  # the first attempt checks in, then its worker dies; Ray runs it again
                        target(job, *rest, _lost=True)
                    except _Lost:
                        pass
                return _Ref(target(job, *rest))

        return Task(target)

    def wait(self, refs, num_returns=1):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def cancel(self, ref, force=False):
        pass

    def kill(self, actor):
        pass


class _Lost(Exception):
    pass


@pytest.fixture
def fake_jobs(monkeypatch):
    def run(job):
        return ShardResult(job.index, {})

    real_task = ray_executor._run_task

    def task(job, setup, counter=None, _lost=False):
        if _lost:
            ray_executor._check_in(counter, job.index)
            raise _Lost()
        return real_task(job, setup, counter)

    monkeypatch.setattr(ray_executor, "run", run)
    monkeypatch.setattr(ray_executor, "_run_task", task)
    return [
        types.SimpleNamespace(index=i, label=f"shard {i}", options=types.SimpleNamespace(threads=1)) for i in range(3)
    ]


def _cluster(monkeypatch, fake):
    monkeypatch.setattr(ray_executor, "_import_ray", lambda: fake)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return ray_executor.RayCluster(None, retries=3)


def test_a_retried_ray_task_reports_its_attempts(monkeypatch, fake_jobs):
    fake = FakeRay(lose=1)
    seen = {}
    _cluster(monkeypatch, fake).run(fake_jobs, lambda job, result: seen.update({job.index: result.attempts}))
    assert seen == {0: 1, 1: 2, 2: 1}
    assert fake.calls == [0, 1, 2]


def test_without_the_counter_attempts_stay_not_counted(monkeypatch, fake_jobs):
    fake = FakeRay(lose=1, counting=False)
    seen = {}
    _cluster(monkeypatch, fake).run(fake_jobs, lambda job, result: seen.update({job.index: result.attempts}))
    assert seen == {0: 0, 1: 0, 2: 0}
