"""The benchmark matrix keeps earlier results: it refuses an existing result file before any run
unless `--replace` is given, a full disk keeps the previous report whole, and a table of a
missing file is one error, not a traceback."""

from __future__ import annotations

import pytest
from course_helpers import WorkStarted
from write_mishaps import full_disk, leftovers  # noqa: F401  (full_disk: a fixture)

from moe_tutorial import safe_io


def test_matrix_refuses_an_earlier_result_before_any_run(monkeypatch, tmp_path, capsys):
    from benchmarks import matrix

    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(matrix, "run_matrix", work)
    monkeypatch.setattr(matrix, "_check_gpus", lambda gpus: None)
    earlier = tmp_path / "h200x2.json"
    earlier.write_text('{"rows": []}')
    with pytest.raises(SystemExit) as exit:
        matrix.main(["--gpus", "2", "--preset", "tiny", "--out", str(earlier)])
    assert exit.value.code == 2 and "--replace" in capsys.readouterr().err
    assert earlier.read_text() == '{"rows": []}'
    with pytest.raises(WorkStarted):
        matrix.main(["--gpus", "2", "--preset", "tiny", "--backend", "grouped_torch",
                     "--out", str(earlier), "--replace"])


def test_matrix_report_on_a_full_disk_keeps_the_previous_version(tmp_path, full_disk):  # noqa: F811
    from benchmarks import matrix

    out = tmp_path / "m.json"
    out.write_text('{"rows": [1]}')
    with pytest.raises(safe_io.WriteFailed, match="No space left"):
        matrix.write_report({"rows": [1, 2]}, str(out))
    assert out.read_text() == '{"rows": [1]}' and leftovers(tmp_path) == []


def test_matrix_table_of_a_missing_file_is_an_error_not_a_traceback(tmp_path, capsys):
    from benchmarks import matrix

    with pytest.raises(SystemExit) as exit:
        matrix.main(["--table", str(tmp_path / "missing.json")])
    assert exit.value.code == 2
    assert "not a readable result JSON" in capsys.readouterr().err
