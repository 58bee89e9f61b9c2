"""The documentation site builds with `mkdocs build --strict`: every page in the nav exists, every internal link
resolves, and every `::: name` API entry is found and its docstring parses without a warning."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mkdocs_build_is_strict_clean(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about MkDocs 2.0
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    for page in ("index.html", "kernels/index.html", "api/stree/index.html"):
        assert os.path.exists(tmp_path / "site" / page), page
    with open(tmp_path / "site" / "api" / "stree" / "index.html") as f:
        reference = f.read()
    for name in ("generate", "GenerationStats", "TreeModel", "DynamicTree", "enable", "demo_pair", "TokenTree"):
        assert f'id="stree.{name}"' in reference, name  # each public name has its generated entry
