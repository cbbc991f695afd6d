"""safe_io: the folder lock and the writes every command shares never go through a link."""

import hashlib
import os

import pytest

from moe_tutorial import safe_io


def test_a_lock_name_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    """A link where the folder lock belongs would have had the lock JSON written through it into
    the learner's file: it is refused in one line, the file untouched."""
    victim = tmp_path / "precious.txt"
    victim.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / safe_io.LOCK_NAME).symlink_to(victim)
    with pytest.raises(safe_io.WriteFailed, match="is a link, where the course keeps its lock file"):
        with safe_io.hold_folder(run, "training run"):
            pass
    assert victim.read_text() == "mine"
    os.mkfifo(run / "fifo")
    (run / safe_io.LOCK_NAME).unlink()
    os.rename(run / "fifo", run / safe_io.LOCK_NAME)
    with pytest.raises(safe_io.WriteFailed, match="is not a plain file"):
        with safe_io.hold_folder(run, "training run"):
            pass


@pytest.mark.parametrize("make", ["link", "fifo", "device", "folder"])
def test_a_read_of_what_is_no_plain_file_is_refused_before_a_byte_is_read(tmp_path, make):
    path = tmp_path / "meta.json"
    if make == "link":
        path.symlink_to("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)  # an open without O_NONBLOCK would wait for a writer forever
    elif make == "folder":
        path.mkdir()
    else:
        path = "/dev/zero"
    with pytest.raises(safe_io.UnsafeRead, match="is a link" if make == "link" else
                       "is not a plain file"):
        with safe_io.open_regular(path):
            pass


def test_a_read_larger_than_its_limit_is_refused_and_one_within_is_read_whole(tmp_path):
    path = tmp_path / "meta.json"
    path.write_bytes(b"x" * 10)
    with pytest.raises(safe_io.UnsafeRead, match="holds 10 bytes, more than the 9"):
        with safe_io.open_regular(path, limit=9):
            pass
    with safe_io.open_regular(path, limit=10) as (f, size):
        assert size == 10 and f.read() == b"x" * 10
    assert safe_io.sha256_of(path) == hashlib.sha256(b"x" * 10).hexdigest()
