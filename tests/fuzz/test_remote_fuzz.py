"""The remote fuzzer (tests/fuzz/remote.py): a short fixed-seed campaign against loopback
servers finds nothing, and its verdicts call every bad ending a finding."""

from __future__ import annotations

import os
import signal

import pytest

from tests.fuzz.remote import ACCEPTED, Behaviour, _verdict, campaign, make_case

posix_only = pytest.mark.skipif(os.name != "posix", reason="FIFOs and POSIX signals")


@posix_only
def test_a_fixed_seed_remote_campaign_finds_nothing():
    summary = campaign(seed=0, cases=8, minutes=None, log=lambda text: None)
    assert summary["cases"] == 8
    assert summary["findings"] == [], summary["findings"]
    assert set(summary["counts"]) <= set(ACCEPTED)


def test_remote_cases_are_a_function_of_the_seed():
    assert make_case(3, 5) == make_case(3, 5)
    assert [make_case(3, n) for n in range(20)] != [make_case(4, n) for n in range(20)]


def test_the_verdicts_call_every_bad_ending_a_finding():
    plain = Behaviour("index")
    assert _verdict(plain, 0, 1.0, "", 0, 3, None) == "exit0"
    assert _verdict(plain, 2, 1.0, "error: x: refused\nhint: y\n", 0, 3, None) == "exit2-one-line"
    assert _verdict(plain, None, 30.0, "", 0, 3, None) == "timeout"
    assert _verdict(plain, 70, 1.0, "error: internal error: ...\n", 0, 3, None) == "internal-error"
    assert _verdict(plain, 2, 1.0, "Traceback (most recent call last):\n", 0, 3, None) == "traceback"
    assert _verdict(plain, 2, 1.0, "error: a\nerror: b\nerror: c\n", 0, 3, None) == "exit2-not-one-line"
    assert _verdict(plain, 2, 1.0, "error: x\n", 1, 3, None) == "reached-forbidden-host"
    assert _verdict(plain, 2, 30.0, "error: x\n", 0, 3, None) == "over-deadline"
    assert _verdict(Behaviour("index", shard_name="file-shard"), 0, 1.0, "", 0, 3, None) == "read-non-http"
    sent = Behaviour("single", actions={1: {"action": "redirect", "to": "ftp"}})
    assert _verdict(sent, 0, 1.0, "", 0, 2, None) == "read-non-http"
    assert _verdict(sent, 0, 1.0, "", 0, 1, None) == "exit0"  # that request never came
    signalled = Behaviour("single", signum=int(signal.SIGTERM), signal_at=1.0)
    assert _verdict(signalled, 143, 2.0, "error: terminated\n", 0, 1, 1.5) == "signal-exit"
    assert _verdict(signalled, 143, 9.0, "error: terminated\n", 0, 1, 1.5) == "slow-signal-exit"
