"""`make site`: a static website of the executed course, from a `make course` run.

    python -m tools.site --run runs/site [--out build/site]

Every chapter (notebooks/NN_*.ipynb) is rendered from its executed copy in the run folder, with
its outputs: on a CPU run the `%%needs_gpu` cells hold the course's committed GPU run, labelled.
The entry page is the README; from it and the chapters, every relative link is followed through
the checkout: a markdown page (the glossary, the notes, docs/) is rendered to HTML, a notebook
that is not a chapter (an exercise, a solution) is rendered as it is, a folder gets a listing
and any other file (a results JSON, a figure) is copied. The site keeps the checkout's layout,
so each link keeps its path with `.md`/`.ipynb` turned into `.html` (a folder into its
`index.html`). nbconvert renders both kinds of page (its HTML exporter, its markdown filter);
what is hand-written here is that walk, the link mapping and the GitHub-style heading anchors
the markdown links use (`docs/gpu.md#without-the-network`), which nbconvert names otherwise.
A link that leads nowhere stops the build, naming it.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import sys
from collections import Counter, deque
from pathlib import Path

from moe_tutorial.course.links import broken_links, retarget_links
from moe_tutorial.course.report import PLOTLY_JS, notebook_page
from moe_tutorial.course.runner import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "build" / "site"
HEADING = re.compile(r"<h([1-6])([^>]*)>(.*?)</h\1>", re.DOTALL)

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body{{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:980px;
 padding:0 1em;color:#1f2328;line-height:1.5}}
table{{border-collapse:collapse;margin:.6em 0;font-size:.92em}}
th,td{{border:1px solid #d0d7de;padding:.25em .6em;vertical-align:top}} th{{background:#f6f8fa}}
pre{{background:#f6f8fa;padding:.6em;overflow-x:auto;font-size:.88em}}
code{{background:#f6f8fa;padding:0 .2em}} img{{max-width:100%}}
.anchor-link{{visibility:hidden;text-decoration:none}} :hover>.anchor-link{{visibility:visible}}
nav.site{{font-size:.9em;border-bottom:1px solid #d0d7de;margin-bottom:1em}}
{highlight}
</style></head><body>
{nav}
{body}
</body></html>
"""


NAV = ('<nav class="site" style="font-family:system-ui,sans-serif;padding:.4em 1em">'
       '<a href="{home}">The course</a> · <a href="{glossary}">Glossary</a></nav>')


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def add_heading_anchors(page: str) -> str:
    """Each heading also answers to GitHub's anchor for it (`-1`, `-2` for repeats), beside the
    one nbconvert gives it."""
    seen: Counter = Counter()

    def one(match: re.Match) -> str:
        text = match.group(3).split('<a class="anchor-link"')[0]
        slug = github_slug(text)
        if not slug:
            return match.group(0)
        suffix = f"-{seen[slug]}" if seen[slug] else ""
        seen[slug] += 1
        return f'<a id="{slug}{suffix}"></a>{match.group(0)}'
    return HEADING.sub(one, page)


def site_path(source: Path) -> Path:
    """Where a file of the checkout lives in the site (relative to both roots)."""
    relative = source.relative_to(ROOT)
    if relative == Path("README.md"):
        return Path("index.html")  # the entry page
    if source.is_dir():
        return relative / "index.html"
    if source.suffix in (".md", ".ipynb"):
        return relative.with_suffix(".html")
    return relative


class SiteBuilder:
    def __init__(self, run: Path, out: Path):
        self.run, self.out = run, out
        self.chapters = {p.name: p for p in sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))}
        self.queue: deque[Path] = deque()
        self.done: set[Path] = set()
        self.dead: list[str] = []

    def check_run(self) -> None:
        missing = [name for name in self.chapters if not (self.run / name).is_file()]
        if missing:
            raise SystemExit(f"error: {self.run} holds no executed {', '.join(missing)}: build "
                             f"the site from a complete run (`make site` runs the course into "
                             f"SITE_RUN first when it has no report.html; delete a stopped run's "
                             f"folder, or name another with SITE_RUN=...)")

    def want(self, source: Path) -> None:
        if source not in self.done:
            self.done.add(source)
            self.queue.append(source)

    def link_for(self, page_source: Path, path: str) -> str | None:
        """A link of `page_source` to `path`, pointed at the target's place in the site (and the
        target queued); None where the target is not in the checkout."""
        if path == PLOTLY_JS and page_source.suffix == ".ipynb":
            return None  # copied next to the chapters' pages (`render`)
        target = (page_source.parent / path).resolve()
        if not target.exists() or ROOT not in (target, *target.parents):
            self.dead.append(f"{page_source.relative_to(ROOT)}: {path}")
            return None
        self.want(target)
        here = (self.out / site_path(page_source)).parent
        return os.path.relpath(self.out / site_path(target), here)

    def nav(self, source: Path) -> str:
        """The bar atop every page: the course's entry page and the glossary."""
        here = (self.out / site_path(source)).parent
        home = os.path.relpath(self.out / "index.html", here)
        glossary = os.path.relpath(self.out / "docs" / "glossary.html", here)
        return NAV.format(home=home, glossary=glossary)

    def wrap(self, source: Path, page: str) -> str:
        """A rendered page with the site's bar: a markdown or folder page's body into PAGE, a
        notebook's page (nbconvert's, whole) with the bar after its <body>."""
        if source.suffix == ".ipynb":
            return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + self.nav(source), page,
                          count=1)
        from pygments.formatters import HtmlFormatter

        title = f"{source.relative_to(ROOT)}/" if source.is_dir() else source.stem
        return PAGE.format(title=html.escape(title), body=page, nav=self.nav(source),
                           highlight=HtmlFormatter().get_style_defs(".highlight"))

    def render(self, source: Path) -> str | None:
        """The page of one source file, its links not yet pointed; None for a file copied."""
        from nbconvert.filters import markdown2html_mistune

        if source.is_dir():
            items = "".join(f'<li><a href="{html.escape(p.name)}">{html.escape(p.name)}</a></li>'
                            for p in sorted(source.iterdir()) if not p.name.startswith("."))
            title = html.escape(f"{source.relative_to(ROOT)}/")
            return f"<h1>{title}</h1><ul>{items}</ul>"
        if source.suffix == ".md":
            return markdown2html_mistune(source.read_text(encoding="utf-8"))
        if source.suffix == ".ipynb":
            executed = self.run / source.name if source.name in self.chapters and \
                source.parent == ROOT / "notebooks" else source
            page, figures = notebook_page(executed, source.stem, source.parent)
            if figures:
                shutil.copy2(self.run / PLOTLY_JS, self.out / "notebooks" / PLOTLY_JS)
            return page
        return None

    def build_one(self, source: Path) -> None:
        destination = self.out / site_path(source)
        destination.parent.mkdir(parents=True, exist_ok=True)
        page = self.render(source)
        if page is None:
            shutil.copy2(source, destination)
            return
        # a folder's listing links its entries by name, relative to the folder itself
        base = source / "index" if source.is_dir() else source
        page = retarget_links(page, lambda path: self.link_for(base, path))
        destination.write_text(self.wrap(source, add_heading_anchors(page)), encoding="utf-8")

    def build(self) -> Path:
        self.check_run()
        if self.out.exists():
            shutil.rmtree(self.out)
        (self.out / "notebooks").mkdir(parents=True)
        self.done.add(ROOT / "README.md")
        self.build_one(ROOT / "README.md")
        for chapter in self.chapters.values():
            self.want(chapter)
        while self.queue:
            self.build_one(self.queue.popleft())
        if self.dead:
            raise SystemExit(f"error: {len(self.dead)} relative link(s) lead outside the "
                             f"checkout or to nothing: {'; '.join(self.dead[:5])}")
        return self.out / "index.html"


def site_broken_links(out: Path) -> dict[str, list[str]]:
    """Every page of a built site whose relative links or anchors lead nowhere."""
    cache: dict = {}
    found = {}
    for page in sorted(out.rglob("*.html")):
        if broken := broken_links(page, cache):
            found[str(page.relative_to(out))] = broken
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.site", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True,
                        help="a `make course` run folder holding every executed chapter")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"the site's folder, replaced whole (default: {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    if not args.run.is_dir():
        parser.error(f"--run {args.run} is not a folder: run the course first, "
                     f"`make course RUN_DIR={args.run}`")
    index = SiteBuilder(args.run.resolve(), args.out.resolve()).build()
    if broken := site_broken_links(args.out.resolve()):
        first = next(iter(broken.items()))
        print(f"error: {sum(map(len, broken.values()))} broken link(s) in the site, e.g. "
              f"{first[0]}: {first[1][0]}", file=sys.stderr)
        return 1
    pages = len(list(args.out.rglob("*.html")))
    print(f"site: {pages} pages; open {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
