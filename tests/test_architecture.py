"""The house rules (ARCHITECTURE.md): the layer order is true (arrows point down, no cycles, no import hidden in a
function to dodge one), functions stay short, and the architecture note names what exists."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_jax", "convert", "kernels_pallas")
MAX_LINES = 80
INTERNAL = ("kimi_jax", "kernels_pallas")

# Bottom to top: a unit imports only units of lower rank (units of one rank never import each other). The root
# package ``kimi_jax`` is the public facade: nothing inside it imports it.
LAYERS = (
    ("kernels_pallas",),
    ("kimi_jax.text",),
    ("kimi_jax.model",),
    ("kimi_jax.parallel",),
    ("kimi_jax.checkpoint",),
    ("kimi_jax.generation",),
    ("kimi_jax.serving", "kimi_jax.training"),
    ("kimi_jax.deploy",),
    ("kimi_jax.analysis",),
    ("kimi_jax.cli",),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _sources(package, root=ROOT):
    return sorted((root / package).rglob("*.py"))


def module_name(path, root=ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root) -> bool:
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def imports(path, root=ROOT):
    """``(target module, line, inside a function)`` for every import of an internal module in ``path``; ``from a
    import b`` targets ``a.b`` when that is a module, else ``a``."""
    tree = ast.parse(path.read_text())
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in INTERNAL:
                yield t, node.lineno, id(node) in local


def unit(module: str) -> str:
    """The layer unit a module belongs to (the root facade is its own unit)."""
    if module.split(".")[0] == "kernels_pallas":
        return "kernels_pallas"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def upward_arrows(root=ROOT) -> list[str]:
    """Every import that points to the facade, to a unit of the same or a higher rank, or to a unit outside
    :data:`LAYERS`."""
    bad = []
    for pkg in INTERNAL:
        for p in _sources(pkg, root):
            src = unit(module_name(p, root))
            for target, line, _ in imports(p, root):
                dst = unit(target)
                if dst == src:
                    continue
                where = f"{p.relative_to(root)}:{line} imports {target}"
                if dst == "kimi_jax" or src == "kimi_jax":
                    if src != "kimi_jax":  # the facade re-exports; nothing below imports it
                        bad.append(f"{where} (the public facade)")
                elif dst not in RANK or src not in RANK:
                    bad.append(f"{where} (a unit missing from LAYERS)")
                elif RANK[dst] >= RANK[src]:
                    bad.append(f"{where} ({src} is rank {RANK[src]}, {dst} rank {RANK[dst]})")
    return bad


def cycles(root=ROOT) -> list[list[str]]:
    """Strongly connected sets of more than one module in the import graph (Tarjan)."""
    graph = {}
    for pkg in INTERNAL:
        for p in _sources(pkg, root):
            graph.setdefault(module_name(p, root), set()).update(t for t, _, _ in imports(p, root))
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def hidden_imports(root=ROOT) -> list[str]:
    """Imports inside functions: of an internal module (they exist only to dodge a cycle or an order), or of a
    third-party one without a comment on its line saying why it is lazy."""
    bad = []
    for pkg in INTERNAL:
        for p in _sources(pkg, root):
            lines = p.read_text().splitlines()
            for node in ast.walk(ast.parse(p.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for n in ast.walk(node):
                    if not isinstance(n, (ast.Import, ast.ImportFrom)) or (isinstance(n, ast.ImportFrom) and n.level):
                        if isinstance(n, ast.ImportFrom) and n.level:
                            bad.append(f"{p.relative_to(root)}:{n.lineno} {ast.unparse(n)} (relative, in a function)")
                        continue
                    names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                    where = f"{p.relative_to(root)}:{n.lineno} {ast.unparse(n)}"
                    if any(m.split(".")[0] in INTERNAL for m in names):
                        bad.append(f"{where} (an internal import inside a function)")
                    elif "#" not in lines[n.end_lineno - 1]:
                        bad.append(f"{where} (lazy without a reason: add a comment on the line)")
    return bad


def test_arrows_point_down():
    bad = upward_arrows()
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles()
    assert not found, found


def test_no_imports_hidden_in_functions():
    bad = hidden_imports()
    assert not bad, "\n".join(bad)


def test_the_layer_checks_can_fail(tmp_path):
    """A tree with an upward arrow, a cycle, a facade import and two hidden imports: each check finds its own."""
    files = {
        "kernels_pallas/__init__.py": "",
        "kernels_pallas/a.py": "import kernels_pallas.b\n",
        "kernels_pallas/b.py": "from kernels_pallas import a\n",
        "kimi_jax/__init__.py": "from kimi_jax.model import m\n",
        "kimi_jax/model/__init__.py": "",
        "kimi_jax/model/m.py": "from kimi_jax.checkpoint import c\nimport kimi_jax\n",
        "kimi_jax/checkpoint/__init__.py": "",
        "kimi_jax/checkpoint/c.py": ("def f():\n    from kimi_jax.model import m\n    import torch\n"
                                     "    import matplotlib  # optional: figures only\n"),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    up = upward_arrows(tmp_path)
    assert any("kimi_jax/model/m.py:1 imports kimi_jax.checkpoint.c" in b for b in up), up
    assert any("m.py:2 imports kimi_jax (the public facade)" in b for b in up), up
    assert not any(b.startswith("kimi_jax/checkpoint/c.py") for b in up), up  # c -> m points down
    assert ["kernels_pallas.a", "kernels_pallas.b"] in cycles(tmp_path)
    hidden = hidden_imports(tmp_path)
    assert [h.split(" (")[1] for h in hidden] == ["an internal import inside a function)",
                                                   "lazy without a reason: add a comment on the line)"], hidden


def test_the_outer_packages_stay_outside():
    """Nothing under kimi_jax/ or kernels_pallas/ imports the converter, benchmarks, notebooks or tests."""
    bad = []
    for pkg in INTERNAL:
        for p in _sources(pkg):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                bad += [f"{p.relative_to(ROOT)} imports {m}" for m in names
                        if m.split(".")[0] in ("convert", "benchmarks", "notebooks", "tests")]
    assert not bad, bad


def _long_functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_LINES:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)"


def test_no_function_longer_than_80_lines():
    long = [f for pkg in PACKAGES for p in _sources(pkg) for f in _long_functions(p)]
    assert not long, long


def test_architecture_note_draws_the_layers_and_names_every_module():
    """The note's diagram lists the units of :data:`LAYERS` top to bottom in the same order; its table names every
    module of kimi_jax/ under its package, and every module and op package of kernels_pallas/; every file it
    names exists."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    diagram = text.split("```")[1]
    drawn = [m.replace("/", ".").rstrip(".") for m in re.findall(r"(?<![\w.])((?:kimi_jax|kernels_pallas)/[\w/]*)",
                                                                  diagram)]
    want = [u for units in reversed(LAYERS) for u in units]
    assert [d for d in drawn if d in want] == want, drawn
    named = set(re.findall(r"`((?:kimi_jax|kernels_pallas|convert)/[\w/]*?\.py)`", text))
    assert not sorted(p for p in named if not (ROOT / p).exists())
    table = {}
    for line in text.splitlines():
        m = re.match(r"\| `((?:kimi_jax|kernels_pallas|convert)/[\w/]*)` \| (.*)\|$", line)
        if m:
            table[m.group(1)] = set(re.findall(r"`(\w+(?:\.py|/))`", m.group(2)))
    missing = []
    for p in _sources("kimi_jax"):
        pkg = f"{p.parent.relative_to(ROOT)}/"
        if p.name != "__init__.py" or p.parent.name == "cli":
            if p.name != "__init__.py" and p.name not in table.get(pkg, set()):
                missing.append(str(p.relative_to(ROOT)))
    ops = {p.parent.name for p in (ROOT / "kernels_pallas").glob("*/__init__.py")}
    mods = {p.name for p in (ROOT / "kernels_pallas").glob("*.py") if p.name != "__init__.py"}
    kp = table.get("kernels_pallas/", set())
    missing += [f"kernels_pallas/{m}" for m in sorted(mods) if m not in kp]
    missing += [f"kernels_pallas/{o}/" for o in sorted(ops) if f"{o}/" not in kp]
    assert not missing, missing


def _tracked_text_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in out:
        path = ROOT / name
        if path.suffix in (".safetensors", ".model", ".png") or not path.is_file():
            continue
        try:
            yield name, path.read_text()
        except UnicodeDecodeError:
            continue


SHARED = re.compile(r"\.\./" + r"shared(?![\w.])")  # written in two parts, so this file does not match itself


def test_the_repository_stands_alone():
    """No tracked file points outside the repository, at the folder beside it that a user's clone does not have: the
    fixture and the benchmark config live in tests/fixtures/ and benchmarks/configs/."""
    bad = [name for name, text in _tracked_text_files() if SHARED.search(text)]
    assert not bad, bad
    assert SHARED.search("see ../" "shared/fixtures") and not SHARED.search('#include "../shared.h"')


def test_readme_is_short_and_its_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    assert links and not [link for link in links if not (ROOT / link).exists()]
