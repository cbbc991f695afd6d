"""A learner without a GPU still sees the GPU: the `%%needs_gpu` cell magic.

A chapter marks each cell whose result needs a CUDA GPU:

    %%needs_gpu speedup curves
    ...the cell's code...

On a CUDA device the cell runs as written. Anywhere else it does not run: it shows the outputs
that this very cell (same source, compared by digest) printed in the course's committed full-mode
GPU run, under one line naming the GPU, the versions and the date, and it defines the names after
the magic (`speedup`, `curves`) with the values they had there, so the cells after it (a graded
prediction, the closing table) work on the GPU's numbers and say so. A cell that run does not
hold (not recorded yet, or edited since) says so in one line and defines its names as None.

The committed run is one JSON file, `benchmarks/results/gpu_course_full.json`, written by
`tools/record_gpu_run.py` from `moe_tutorial run` on a GPU made with $MOE_TUTORIAL_RECORD_GPU=1
(each chapter with the GPU, versions, mode and date of the run that executed it) (which makes each such cell also display its names' values, as JSON,
for the recorder). `tests/course/test_gpu_replay.py` fails when a chapter's marked cell has no committed
output for its current source."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tokenize

from ..perf import results

MAGIC = "needs_gpu"
RECORD_FILE = "gpu_course_full.json"
RECORD_ENV = "MOE_TUTORIAL_RECORD_GPU"
REPLAY_ENV = "MOE_TUTORIAL_GPU_RUN"  # another recorded run to show (a JSON the recorder wrote)
KEPT_MIME = "application/vnd.moe-tutorial.kept+json"
# What a recorded output keeps: text, tables (small HTML) and figures (plotly JSON), not images or
# widget state, so the committed run stays a compact text file.
KEPT_MIMETYPES = ("text/plain", "text/markdown", "text/html", "application/vnd.plotly.v1+json")
MAX_OUTPUT_BYTES = 200_000


def cell_digest(source: str) -> str:
    """The digest that ties a recorded output to the cell source that printed it: the whole cell,
    magic line included, with comments, trailing spaces and blank lines ignored (none of them
    changes what the cell prints, so a reworded comment keeps its recorded output)."""
    lines = [line.rstrip() for line in _without_comments(source).splitlines() if line.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _without_comments(source: str) -> str:
    """`source` less its comments, read by Python's tokenizer (so a `#` inside a string stays).
    Source the tokenizer cannot read is taken whole: its comments then count as code."""
    try:
        tokens = [token for token in tokenize.generate_tokens(io.StringIO(source).readline)
                  if token.type != tokenize.COMMENT]
        return tokenize.untokenize(tokens)
    except (tokenize.TokenError, SyntaxError, ValueError):
        return source


def magic_names(source: str) -> list[str] | None:
    """The names a `%%needs_gpu` cell keeps, or None when `source` is not such a cell."""
    first = source.lstrip().split("\n", 1)[0].split()
    if not first or first[0] != f"%%{MAGIC}":
        return None
    return first[1:]


def label(environment: dict, *, first: bool = True) -> str:
    """The one line above a replayed output: which GPU, which versions, when; after the first
    replayed cell of a run, which GPU only (the rest is the same, and stated there)."""
    gpu = environment.get("gpu", "a GPU")
    if not first:
        return f"[committed GPU run on the {gpu}, as at this notebook's first such cell]"
    versions = ", ".join(f"{name} {environment[key]}" for name, key in
                         (("torch", "torch"), ("TE", "transformer_engine"), ("CUDA", "cuda"))
                         if environment.get(key))
    return (f"[committed GPU run: {gpu}, {versions}, {environment.get('mode', 'full')} mode, "
            f"{environment.get('date', 'undated')}; this machine has no CUDA GPU, so the cell "
            f"shows that run's output]")


def load_record() -> dict | None:
    """The GPU run to show: $MOE_TUTORIAL_GPU_RUN where set (a run you recorded yourself), else
    the committed one, or None where the clone has none (an installed package)."""
    given = os.environ.get(REPLAY_ENV)
    found = results.path(given) if given else results.find(RECORD_FILE)
    return json.loads(found.read_text()) if found is not None else None


def find_cell(record: dict | None, digest: str) -> tuple[dict, dict] | None:
    """The recorded cell of this digest and the environment of the run that executed it."""
    if not record:
        return None
    for chapter in record.get("chapters", {}).values():
        for cell in chapter.get("cells", []):
            if cell.get("digest") == digest:
                return cell, chapter.get("environment", {})
    return None


def compact_outputs(outputs: list[dict]) -> tuple[list[dict], dict]:
    """An executed cell's outputs as the record keeps them, and the values its magic kept."""
    kept, compact = {}, []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            compact.append({"stream": output.get("name", "stdout"), "text": _text(output.get("text"))})
        elif kind in ("display_data", "execute_result"):
            data = output.get("data", {})
            if KEPT_MIME in data:
                kept.update(data[KEPT_MIME])
                continue
            bundle = {mime: (_text(value) if isinstance(value, (str, list)) else value)
                      for mime, value in data.items() if mime in KEPT_MIMETYPES}
            bundle = {mime: value for mime, value in bundle.items()
                      if len(json.dumps(value)) <= MAX_OUTPUT_BYTES} or {
                "text/plain": "(an output too large for the committed run)"}
            compact.append({"data": bundle})
    return compact, kept


def _run(shell, cell: str) -> None:
    """Run a cell's code in the notebook's namespace as IPython would: an error stops the cell
    (and a headless run), a last bare expression is displayed."""
    import ast

    from IPython.display import display

    tree = ast.parse(shell.transform_cell(cell))
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<needs_gpu cell>", "exec"), shell.user_ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<needs_gpu cell>", "eval"), shell.user_ns)
        if value is not None:
            display(value)


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def replay(cell: dict, environment: dict, *, first: bool = True) -> None:
    """Show a recorded cell's outputs under its label (what it printed and displayed; its
    warnings on stderr stay in the record); `first`: the label in full."""
    from IPython.display import display

    print(label(environment, first=first), flush=True)
    for output in cell.get("outputs", []):
        if output.get("stream") == "stderr":
            continue  # the GPU process's warnings (its paths, its libraries): not the lesson
        if "stream" in output:
            sys.stdout.write(output["text"])
            sys.stdout.flush()
        else:
            display(output["data"], raw=True)


class NeedsGpu:
    """The `%%needs_gpu NAME ...` cell magic of a notebook whose device is `device`."""

    def __init__(self, device: str):
        self.on_gpu = device.startswith("cuda")
        self.labelled: list[dict] = []  # the environments whose label was shown in full

    def __call__(self, line: str, cell: str) -> None:
        from IPython import get_ipython

        shell = get_ipython()
        names = line.split()
        if self.on_gpu:
            _run(shell, cell)
            if os.environ.get(RECORD_ENV) == "1":
                self._show_kept(shell, names)
            return
        record = load_record()
        recorded = find_cell(record, cell_digest(f"%%{MAGIC} {line}\n{cell}"))
        if recorded is None:
            where = ("the committed GPU run holds no output of this version of it (not recorded "
                     "yet, or edited since)" if record else
                     f"there is no committed GPU run ({results.FOLDER}/{RECORD_FILE}) in this clone")
            print(f"[this cell needs a CUDA GPU, and {where}: it did not run; "
                  f"{', '.join(names) or 'nothing'} set to None]")
            shell.user_ns.update({name: None for name in names})
            return
        cell_record, environment = recorded
        replay(cell_record, environment, first=environment not in self.labelled)
        self.labelled.append(environment)
        shell.user_ns.update({name: cell_record["kept"].get(name) for name in names})

    @staticmethod
    def _show_kept(shell, names: list[str]) -> None:
        from IPython.display import display

        missing = [name for name in names if name not in shell.user_ns]
        if missing:
            raise NameError(f"%%{MAGIC} keeps {missing}, which the cell did not define; "
                            f"define them in the cell or drop them from its first line")
        try:
            values = json.loads(json.dumps({name: shell.user_ns[name] for name in names}))
        except TypeError as exc:
            raise TypeError(f"%%{MAGIC} keeps only JSON values (numbers, strings, lists, dicts): "
                            f"{exc}; keep a plain summary of it instead") from None
        display({KEPT_MIME: values}, raw=True)


def register(device: str) -> bool:
    """Register `%%needs_gpu` in the running IPython shell (`lesson.setup` does); False outside
    IPython."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return False
    shell.register_magic_function(NeedsGpu(device), magic_kind="cell", magic_name=MAGIC)
    return True
