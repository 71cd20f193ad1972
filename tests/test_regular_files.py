"""qtool.formats.regular_files: a stranger's small file read through one checked descriptor
(issue 18 #4): a FIFO is never waited on, a device never read, a link never followed where
asked not to, a file swapped since it was checked refused, and no more than limit + 1 bytes."""

from __future__ import annotations

import os

import pytest

from qtool.formats.regular_files import NotReadable, read_regular


def test_a_regular_file_is_read_whole_and_one_byte_over_the_limit_at_most(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_regular(str(path), 1000) == b"x" * 100
    assert read_regular(str(path), 10) == b"x" * 11  # over the limit: the caller says so


def test_a_fifo_is_refused_at_once(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    with pytest.raises(NotReadable, match="not a regular file"):
        read_regular(str(path), 1000)


def test_a_device_is_refused():
    with pytest.raises(NotReadable, match="not a regular file"):
        read_regular("/dev/zero", 1000)


def test_a_link_is_not_followed_when_asked_not_to(tmp_path):
    (tmp_path / "target").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert read_regular(str(tmp_path / "link"), 10) == b"x"
    with pytest.raises(NotReadable, match="it is a link"):
        read_regular(str(tmp_path / "link"), 10, follow=False)


def test_a_file_replaced_since_it_was_checked_is_refused(tmp_path):
    path = tmp_path / "f"
    path.write_text("first")
    checked = os.stat(path)
    (tmp_path / "g").write_text("second")
    os.replace(tmp_path / "g", path)
    with pytest.raises(NotReadable, match="replaced"):
        read_regular(str(path), 100, expect=checked)


def test_a_file_outside_the_allowed_folders_is_refused(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "outside").write_text("secret")
    with pytest.raises(NotReadable, match="out of the model folder"):
        read_regular(str(tmp_path / "outside"), 100, inside=(str(tmp_path / "inside"),))
