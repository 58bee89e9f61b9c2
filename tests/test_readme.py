"""Every python example in the README runs as written, in order, in one namespace (as a reader would paste them)."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def python_blocks():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_the_readme_has_examples():
    assert len(python_blocks()) >= 3


def test_readme_python_examples_run_in_order():
    namespace = {"__name__": "__readme__"}
    for number, block in enumerate(python_blocks(), 1):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:  # name the block that failed
            raise AssertionError(f"README python block {number} failed: {error!r}\n{block}") from error
