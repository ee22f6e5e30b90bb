"""The house rules (ARCHITECTURE.md): arrows point down, functions stay short, the architecture note stays true."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_jax", "convert", "kernels_pallas")
MAX_LINES = 80


def _sources(package):
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path) -> set[str]:
    """Top-level package of every module ``path`` imports (function-local imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_arrows_point_down():
    up = {"kimi_jax": {"convert", "benchmarks", "notebooks", "tests"},
          "kernels_pallas": {"kimi_jax", "convert", "benchmarks", "notebooks", "tests"},
          "convert": {"benchmarks", "notebooks", "tests"}}
    bad = [f"{p.relative_to(ROOT)} imports {m}" for pkg, banned in up.items() for p in _sources(pkg)
           for m in _imports(p) & banned]
    assert not bad, bad


def test_the_arrow_check_can_fail(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from convert import converter\n")
    assert _imports(p) == {"convert"}


def _long_functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_LINES:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)"


def test_no_function_longer_than_80_lines():
    long = [f for pkg in PACKAGES for p in _sources(pkg) for f in _long_functions(p)]
    assert not long, long


def test_architecture_note_names_what_exists():
    """Every file the note names exists, and every package folder under kimi_jax/ is in it."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:kimi_jax|kernels_pallas|convert)/[\w/]*?\.py)`", text))
    assert len(named) > 15
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
    packages = sorted(p.name for p in (ROOT / "kimi_jax").iterdir() if (p / "__init__.py").exists())
    assert all(f"kimi_jax/{p}/" in text for p in packages), packages
    for line in text.splitlines():  # the table's module lists: each module under its package
        m = re.match(r"\| `((?:kimi_jax|kernels_pallas|convert)/[\w/]*)` \| (.*)\|$", line)
        if m:
            for mod in re.findall(r"`(\w+\.py)`", m.group(2)):
                assert (ROOT / m.group(1) / mod).exists(), f"{m.group(1)}{mod}"
