"""`make lab`'s working copy (moe_tutorial/course/workspace.py): chapters and exercises side by side with
every link between them working, a learner's files never overwritten, and their saved work never
touching a tracked file."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkout_copy import copy_tracked_files
from notebook_conventions import assert_parameters_and_no_outputs

from moe_tutorial import cli
from moe_tutorial.course import workspace

ROOT = Path(__file__).resolve().parents[2]
# A markdown link or an <img src=...>: the targets a reader follows in Lab.
LINK = re.compile(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"")


def relative_links(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    targets = [a or b for a, b in LINK.findall(text)]
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]


def test_every_link_between_chapters_exercises_and_solutions_works_in_the_workspace(tmp_path):
    work = workspace.prepare_workspace(workspace=tmp_path / "work")
    copied = {folder: sorted(p.name for p in (work / folder).glob("*.ipynb"))
              for folder in workspace.COPIED_FOLDERS}
    assert copied == {folder: sorted(p.name for p in (ROOT / folder).glob("*.ipynb"))
                      for folder in workspace.COPIED_FOLDERS}
    followed, broken = set(), []
    for notebook in sorted(work.rglob("*.ipynb")):
        for target in relative_links(notebook):
            resolved = (notebook.parent / target).resolve()
            inside = resolved.relative_to(work.resolve())
            if (inside.parts[0] not in workspace.COPIED_FOLDERS
                    and inside.as_posix() not in workspace.COPIED_FILES):
                continue  # outside what is copied (the repository's README)
            followed.add((notebook.relative_to(work).as_posix(),
                          resolved.relative_to(work.resolve()).as_posix()))
            if not resolved.is_file():
                broken.append(f"{notebook.relative_to(work)} -> {target}")
    assert not broken, broken
    for exercise in copied["exercises"]:  # each chapter's link into its exercise, and back
        chapter = next(name for name in copied["notebooks"] if name[:2] == exercise[:2])
        assert (f"notebooks/{chapter}", f"exercises/{exercise}") in followed
        assert (f"exercises/{exercise}", f"notebooks/{chapter}") in followed


GLOSSARY_LINK = re.compile(r"\]\(\.\./docs/glossary\.md#([^)\s]+)\)")


def test_the_glossary_and_every_link_into_it_work_in_the_workspace(tmp_path):
    """A notebook links a term as `[term](../docs/glossary.md#anchor)`: the glossary is copied
    into the workspace beside the notebooks, and every linked anchor is in it."""
    work = workspace.prepare_workspace(workspace=tmp_path / "work")
    glossary = work / "docs" / "glossary.md"
    assert glossary.read_bytes() == (ROOT / "docs" / "glossary.md").read_bytes()
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', glossary.read_text()))
    assert anchors
    # What a chapter writes, followed from where the learner opens it
    assert (work / "notebooks" / "../docs/glossary.md").resolve() == glossary.resolve()
    missing = []
    for notebook in sorted(work.rglob("*.ipynb")):
        text = "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]
                         if c["cell_type"] == "markdown")
        missing += [f"{notebook.relative_to(work)} -> #{anchor}"
                    for anchor in GLOSSARY_LINK.findall(text) if anchor not in anchors]
    assert not missing, missing


def test_the_notebooks_read_no_path_relative_to_where_they_run():
    """Committed results are read through `perf.results`, which finds the clone from the current
    directory up, never from a module's `__file__`: a chapter runs the same from work/ as from the
    repository."""
    relative = []
    for folder in workspace.COPIED_FOLDERS:
        for notebook in sorted((ROOT / folder).glob("*.ipynb")):
            for cell in json.loads(notebook.read_text())["cells"]:
                source = "".join(cell["source"])
                if cell["cell_type"] == "code" and re.search(r"[\"']\.\./|Path\(\"\.\.|__file__", source):
                    relative.append(f"{folder}/{notebook.name}")
    assert not relative, relative


def test_a_learners_files_are_kept_and_a_deleted_one_comes_back_fresh(tmp_path, capsys):
    work = workspace.prepare_workspace(workspace=tmp_path / "work")
    assert "added" in capsys.readouterr().out
    chapter = work / "notebooks" / "01_naive_moe.ipynb"
    exercise = work / "exercises" / "01_router_and_loop.ipynb"
    edited = json.loads(chapter.read_text())
    edited["cells"][0]["source"] = ["my notes"]
    chapter.write_text(json.dumps(edited))
    exercise.unlink()
    workspace.prepare_workspace(workspace=work)
    out = capsys.readouterr().out
    assert json.loads(chapter.read_text()) == edited
    assert exercise.read_bytes() == (ROOT / "exercises" / exercise.name).read_bytes()
    assert "added 1 file(s) (exercises/01_router_and_loop.ipynb)" in out
    assert "kept your" in out and "delete or rename it" in out


def test_bad_places_are_refused_in_one_line(tmp_path):
    (tmp_path / "work").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        workspace.prepare_workspace(workspace=tmp_path / "work")
    with pytest.raises(FileNotFoundError, match="clone of the course"):
        workspace.prepare_workspace(repo=tmp_path, workspace=tmp_path / "elsewhere")


@pytest.mark.parametrize("root", [True, False])
def test_lab_starts_on_the_workspace_and_as_root_says_so(tmp_path, monkeypatch, capsys, root):
    monkeypatch.setattr(workspace.os, "geteuid", lambda: 0 if root else 1000)
    argv = workspace.lab_argv(tmp_path, ["--no-browser"])
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={tmp_path}" in argv and argv[-1] == "--no-browser"
    assert ("--allow-root" in argv) == root
    started = []
    monkeypatch.chdir(ROOT)  # the clone `make lab` copies from
    monkeypatch.setattr(workspace, "WORKSPACE_NAME", str(tmp_path / "work"))  # absolute: wins
    monkeypatch.setattr(cli.os, "execv", lambda path, args: started.append(args))
    cli.main(["lab", "--", "--port", "8890"])
    (args,) = started
    assert args[-2:] == ["--port", "8890"] and f"--ServerApp.root_dir={tmp_path / 'work'}" in args
    out = capsys.readouterr().out
    assert ("running as root" in out) == root
    assert (tmp_path / "work" / "notebooks" / "00_setup.ipynb").is_file()


def _clone_of_this_checkout(target: Path) -> Path:
    """The tracked files of this working tree (edits included), committed in a new repository."""
    copy_tracked_files(target)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clone"]):
        subprocess.run(["git", *command], cwd=target, check=True, env=env)
    return target


def _save_as_lab_does(notebook: Path, edit) -> None:
    """What JupyterLab writes on save: the cells as edited, with outputs and execution counts,
    and a checkpoint copy beside the file."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    edit(nb)
    for count, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
        cell.execution_count = count
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"ran {count}\n")]
    checkpoints = notebook.parent / ".ipynb_checkpoints"
    checkpoints.mkdir(exist_ok=True)
    nbformat.write(nb, notebook)
    shutil.copy2(notebook, checkpoints / f"{notebook.stem}-checkpoint.ipynb")


def test_a_learners_saved_work_leaves_git_clean_and_the_checks_green(tmp_path, monkeypatch):
    repo = _clone_of_this_checkout(tmp_path / "clone")
    work = workspace.prepare_workspace(repo=repo)
    assert work == repo / "work"

    def answer_the_exercise(nb):
        todo = next(c for c in nb.cells if c.cell_type == "code" and "NotImplementedError" in c.source)
        todo.source = "# my answer\n" + todo.source.replace("raise NotImplementedError", "pass")

    _save_as_lab_does(work / "notebooks" / "01_naive_moe.ipynb",
                      lambda nb: nb.cells.append(__import__("nbformat").v4.new_code_cell("1 + 1")))
    _save_as_lab_does(work / "exercises" / "01_router_and_loop.ipynb", answer_the_exercise)

    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    assert status == ""
    # the no-outputs checks of the chapters and exercises, and `build --check`, on that clone
    for folder in ("notebooks", "exercises"):
        for notebook in sorted((repo / folder).glob("[0-9][0-9]_*.ipynb")):
            assert_parameters_and_no_outputs(notebook)
    monkeypatch.chdir(repo)
    assert cli.main(["build", "--check"]) == 0
    # and the next `make lab` keeps what the learner saved
    saved = (work / "exercises" / "01_router_and_loop.ipynb").read_bytes()
    workspace.prepare_workspace(repo=repo)
    assert (work / "exercises" / "01_router_and_loop.ipynb").read_bytes() == saved
    assert b"# my answer" in saved
