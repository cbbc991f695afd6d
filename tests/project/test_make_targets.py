"""What the Makefile's targets hand their commands (`make -n`: printed, nothing run)."""

import re
import shutil
import subprocess

import pytest
from checkout_copy import ROOT

from moe_tutorial.course import runner

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def dry_run(*args: str) -> str:
    # --no-print-directory: under `make test` (a make inside make) make would add its
    # "Entering directory" lines around the commands
    done = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_lab_opens_on_the_first_chapter_without_the_news_prompt():
    command = dry_run("lab")
    first = re.search(r"--LabApp\.default_url=/lab/tree/(\S+)", command).group(1)
    assert (ROOT / first).is_file() and first == "notebooks/01_naive_moe.ipynb"
    assert "--LabApp.news_url=None" in command
    # the learner's own flags come after the defaults, so theirs win
    mine = dry_run("lab", "LAB_FLAGS=--LabApp.default_url=/lab")
    assert mine.rstrip().endswith("--LabApp.news_url=None --LabApp.default_url=/lab")


def test_course_tells_the_runner_it_was_started_by_make():
    command = dry_run("course", "RUN_DIR=runs/x")
    assert f"{runner.STARTED_BY_ENV}=make" in command and "--out runs/x" in command


def test_test_keeps_what_only_the_tests_import_out_of_the_environment():
    assert "--test-only" in dry_run("test")


def test_site_renders_the_run_it_names():
    command = dry_run("site", "SITE_RUN=runs/mine")
    assert "-m tools.site --run runs/mine --out build/site" in command
