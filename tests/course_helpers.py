"""What the runner's, the builder's and the bad-input tests share: small notebooks written to disk,
a snapshot of a folder's files, a small checkpoint saved the course's way, the check that a
command line refuses in one line, and three
fixtures (registered in conftest.py): the runner's fast path, a throwaway checkout of the course,
and `no_work`, which stops a command the moment it starts its real work."""

from pathlib import Path

import pytest
import torch

from moe_tutorial.train import checkpoint


def notebook(path: Path, *sources: str, parameters: str = "") -> Path:
    """A notebook of code cells at `path` (the first one tagged `parameters` if given)."""
    import nbformat  # the course extra, imported only by the tests that write notebooks
    from nbformat.v4 import new_code_cell, new_notebook

    cells = []
    if parameters:
        cells.append(new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    cells += [new_code_cell(src) for src in sources]
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python",
                                                            "display_name": "Python 3"}})
    nbformat.write(nb, path)
    return path


def save_checkpoint(directory, step: int, keep: int = 3) -> Path:
    """A checkpoint of a tiny model at `step` in `directory`, as `train` saves it; its path."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.Checkpointing(directory, keep=keep).save(model, optimizer, step, [], {}, {})
    return checkpoint.path_for(directory, step)


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def fast_papermill(monkeypatch):
    """The runner's fast path: papermill without a kernel. The executed copy is the source
    notebook; a notebook whose code says FAIL fails, one that says STOP is killed mid-run."""
    import papermill

    def execute_notebook(source, output, **_):
        text = Path(source).read_text()
        Path(output).write_text(text)
        if "STOP" in text:
            raise KeyboardInterrupt
        if "FAIL" in text:
            raise RuntimeError("failed on purpose")

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)


@pytest.fixture()
def fake_checkout(tmp_path, monkeypatch):
    """A checkout of the course in tmp_path, as the runner and the builder see it (the clone the
    current directory is in): tests that point them at the course's own
    folders can do no harm, even to a version of the package without the guards."""
    repo = tmp_path / "checkout"
    for folder in ("notebooks", "exercises", "solutions", "moe_tutorial"):
        (repo / folder).mkdir(parents=True)
    notebook(repo / "notebooks" / "00_setup.ipynb", "print(0)", parameters="MODE = ''")
    monkeypatch.chdir(repo)
    return repo


class WorkStarted(Exception):
    """The command got past its checks and started its real work."""


@pytest.fixture
def no_work(monkeypatch):
    """Loading the training data ends a command-line case: a refusal must come before it."""
    from moe_tutorial.train import data

    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(data, "load_protein_data", work)


def one_line_error(capsys, argv: list[str], *words: str, code: int = 2) -> str:
    """`main(argv)` exits with `code` and one line `error: ...` holding every one of `words`."""
    from moe_tutorial.cli import main

    try:
        result = main(argv)
    except SystemExit as exit:
        result = exit.code
    err = capsys.readouterr().err.strip().splitlines()
    assert result == code, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0], err[0]
    return err[0]
