"""A write never goes through a link: not into the course's own folders, and not elsewhere
either; the refusal says to remove the link, and both the link and its target are kept."""

from __future__ import annotations

import pytest
from write_mishaps import course_dir  # noqa: F401  (a fixture)

from moe_tutorial import safe_io


def test_a_link_into_the_course_is_never_written_through(tmp_path, course_dir):  # noqa: F811
    link = tmp_path / "mine.ipynb"
    link.symlink_to(course_dir / "solutions" / "01_router.ipynb")
    with pytest.raises(safe_io.UnsafeWrite, match="inside the course's own solutions/.*remove "
                                                  "the link"):
        safe_io.write_text(link, "overwritten", replace=True)
    assert (course_dir / "solutions" / "01_router.ipynb").read_text() == "the solution"


def test_a_link_elsewhere_is_refused_and_both_kept(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("kept")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    with pytest.raises(safe_io.UnsafeWrite, match="is a link .*remove the link"):
        safe_io.write_json(link, {"new": 1}, replace=True)
    assert target.read_text() == "kept" and link.is_symlink()
