"""The notebooks: committed without outputs, each with a Colab link and an install-if-missing first code cell, and
each executed top to bottom on CPU (nbclient, a kernel on this interpreter; 03-05 with -m slow) -- any failing cell
fails the test, and every matplotlib figure a notebook draws must carry a title, axis labels and units."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
REPO_URL = "https://github.com/kimi-jax/kimi-jax"
COLAB = "https://colab.research.google.com/github/kimi-jax/kimi-jax/blob/main/notebooks/"
# name -> figures it must draw (each is checked for titles and labels)
EXPECTED = {"01_quickstart.ipynb": 0, "02_convert_and_run.ipynb": 0, "03_inside_k3.ipynb": 4, "04_planning.ipynb": 2,
            "05_recall.ipynb": 1}
KERNEL = "kimi-jax-test"


def figure_problems(fig) -> list[str]:
    """What a figure lacks: a title on every plot axis, x and y labels naming a unit in parentheses, a label on
    every colorbar."""
    out = []
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            if "(" not in ax.get_ylabel() + ax.get_xlabel():
                out.append("colorbar without a label naming its unit")
            continue
        if not ax.get_title():
            out.append("axis without a title")
        for which, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if "(" not in label:
                out.append(f"{which} label {label!r} names no unit")
    return out


def _load(name):
    import nbformat

    with open(os.path.join(NOTEBOOKS, name)) as f:
        return nbformat.read(f, as_version=4)


def test_the_notebooks_exist():
    assert sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_without_outputs(name):
    nb = _load(name)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has outputs: strip them"
    assert "widgets" not in nb.metadata


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_colab_link_and_install_cell(name):
    nb = _load(name)
    assert COLAB + name in nb.cells[0].source, f"{name}: the first cell needs the Open in Colab link to itself"
    first_code = next(c.source for c in nb.cells if c.cell_type == "code")
    assert re.search(r"try:\s+import kimi_jax", first_code) and "except ImportError:" in first_code
    assert f'%pip install -q "kimi-jax[notebooks] @ git+{REPO_URL}"' in first_code
    assert nb.metadata.kernelspec.name == "python3"  # what Colab and a plain Jupyter expect


# Runs a notebook's install cell in a fresh IPython shell where kimi_jax is not importable, with `%pip` recorded
# instead of run: the branch a fresh Colab runtime takes.
_FRESH_RUNTIME = """
import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
calls = []
shell.register_magic_function(lambda line: calls.append(line), "line", "pip")  # replaces %pip
sys.modules["kimi_jax"] = None  # import kimi_jax -> ImportError
result = shell.run_cell(sys.stdin.read())
print(json.dumps({"ok": result.success, "calls": calls}))
"""


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_install_cell_on_a_fresh_runtime(name):
    import subprocess

    first_code = next(c.source for c in _load(name).cells if c.cell_type == "code")
    env = {**os.environ, "PATH": "/nonexistent"}  # no nvidia-smi: a CPU runtime (no /dev/accel* here either)
    env.pop("TPU_ACCELERATOR_TYPE", None)
    out = subprocess.run([sys.executable, "-c", _FRESH_RUNTIME], input=first_code, capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"], out.stdout + out.stderr
    accel = "tpu" if any(p.startswith("accel") for p in os.listdir("/dev")) else "cpu"
    assert got["calls"] == [f'install -q "kimi-jax[notebooks] @ git+{REPO_URL}" "jax[{accel}]"']


def test_readme_links_every_notebook_and_extra_exists():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for name in EXPECTED:
        assert COLAB + name in readme, f"README lacks the Colab link of {name}"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert re.search(r"^notebooks = \[.*matplotlib", f.read(), re.M), "pyproject needs the notebooks extra"



def test_one_repository_url_everywhere():
    """Colab links and pip installs in the README and every notebook name the same repository."""
    texts = [open(os.path.join(ROOT, "README.md")).read()]
    texts += [open(os.path.join(NOTEBOOKS, n)).read() for n in EXPECTED]
    pattern = r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)|git\+https://github\.com/([\w.-]+/[\w.-]+)"
    repos = {a or b for t in texts for a, b in re.findall(pattern, t)}
    assert repos == {"kimi-jax/kimi-jax"}, repos


# Run in the kernel before the notebook: check every figure after each cell, before the inline backend closes it.
_HOOK = f"""
import sys
sys.path.insert(0, {ROOT!r})
from tests.test_notebooks import figure_problems as _figure_problems
_fig_report = {{"checked": 0, "problems": []}}

def _check_figures(*_):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for n in plt.get_fignums():
        fig = plt.figure(n)
        if getattr(fig, "_kimi_checked", False):
            continue
        fig._kimi_checked = True
        _fig_report["checked"] += 1
        title = " / ".join(a.get_title() for a in fig.axes if a.get_title())
        _fig_report["problems"] += [f"figure {{title!r}}: {{p}}" for p in _figure_problems(fig)]

get_ipython().events.register("post_execute", _check_figures)
"""
_REPORT = "import json; print(json.dumps(_fig_report))"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory, monkeypatch_module):
    """A kernelspec running this interpreter (CI's fresh .venv registers none), found first on JUPYTER_PATH; two
    simulated CPU devices so notebook 02's mesh really shards."""
    path = tmp_path_factory.mktemp("jupyter")
    spec = path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kimi-jax tests", "language": "python"}))
    monkeypatch_module.setenv("JUPYTER_PATH", str(path))
    monkeypatch_module.setenv("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch_module.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=2".strip())
    monkeypatch_module.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in Jupyter
    monkeypatch_module.setenv("TMPDIR", str(tmp_path_factory.mktemp("notebook-tmp")))  # checkpoints they write
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def executed(kernel_env):
    """``run(name) -> (executed notebook, exception or None)``: a notebook executed in its own kernel process, once,
    when a test first asks for it (notebooks whose test is deselected never run)."""
    import asyncio

    import nbformat
    from nbclient import NotebookClient

    done = {}

    def run(name):
        if name not in done:
            nb = _load(name)
            nb.cells.insert(0, nbformat.v4.new_code_cell(_HOOK))
            nb.cells.append(nbformat.v4.new_code_cell(_REPORT))
            client = NotebookClient(nb, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": NOTEBOOKS}})
            try:
                asyncio.run(client.async_execute())  # raises CellExecutionError naming the cell on the first failure
                done[name] = nb, None
            except Exception as e:  # reported by that notebook's test
                done[name] = nb, e
        return done[name]

    return run


# 03-05 -m slow (CI time, the 30-minute budget): the quickstart and the convert-and-run notebooks, the first hour's,
# run in the default set; every notebook's install cell, links and committed state are checked there too
RUN_BY_DEFAULT = ("01_quickstart.ipynb", "02_convert_and_run.ipynb")


@pytest.mark.parametrize("name", [n if n in RUN_BY_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(EXPECTED)])
def test_notebook_runs_top_to_bottom(name, executed):
    nb, error = executed(name)
    if error is not None:
        raise error
    for cell in nb.cells[1:-1]:
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, errors
    report = json.loads("".join(o.text for o in nb.cells[-1].outputs if o.output_type == "stream"))
    assert report["problems"] == [], report["problems"]
    assert report["checked"] == EXPECTED[name], f"{name} drew {report['checked']} figures, expected {EXPECTED[name]}"
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images == EXPECTED[name], f"{name} displayed {images} images"
    assert len(nb.cells) == len(_load(name).cells) + 2
