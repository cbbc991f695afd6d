"""What every benchmark driver that writes one JSON report shares: its `--out` and `--replace`
options, and the claim on that file for the whole run, so an existing report is refused (or,
with `--replace`, replaced) before any work, and a refusal is one line on stderr with exit code 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from moe_tutorial.safe_io import REFUSALS, claim_output, refusal_line


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--replace", action="store_true",
                        help="--out may name an existing file, replaced by this report (default: "
                             "an existing --out is refused before anything runs)")


def run_into_report(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    run: Callable[[argparse.Namespace], object], driver: str) -> int:
    """`run(args)` while this process holds `args.out` (`safe_io.claim_output`; `driver` names
    the writer to a second process that tries the same file); 0, or exit 2 with the refusal."""
    try:
        with claim_output(args.out, driver, replace=args.replace, flag="--out",
                          make_parents=True):
            run(args)
    except REFUSALS as exc:
        parser.exit(2, f"error: {refusal_line(exc)}\n")
    return 0
