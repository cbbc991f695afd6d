"""safe_io: the folder lock and the writes every command shares never go through a link."""

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
