"""Every python example in the README, and in each page of docs/, runs as written, in order, in one namespace per
file (as a reader would paste them)."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOC_PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def python_blocks(path=README):
    with open(path) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def run_in_order(path):
    namespace = {"__name__": "__readme__"}
    name = os.path.relpath(path, ROOT)
    for number, block in enumerate(python_blocks(path), 1):
        try:
            exec(compile(block, f"{name} python block {number}", "exec"), namespace)
        except Exception as error:  # name the block that failed
            raise AssertionError(f"{name} python block {number} failed: {error!r}\n{block}") from error


def test_the_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_python_examples_run_in_order():
    run_in_order(README)


def test_the_docs_have_examples():
    with_examples = [page for page in DOC_PAGES if python_blocks(page)]
    assert len(with_examples) >= 6, with_examples


@pytest.mark.parametrize("page", [p for p in DOC_PAGES if python_blocks(p)], ids=lambda p: os.path.relpath(p, ROOT))
def test_docs_python_examples_run_in_order(page):
    run_in_order(page)
