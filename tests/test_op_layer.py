"""The op layer's contract with the model: the model math has no backend branches, every op places itself.

* The model files call ops; no platform name, ``default_backend`` or backend-specific helper appears in their code
  (identifiers and short string literals; prose in docstrings and comments may still say "CPU").
* :func:`kernels_pallas._dispatch.split_axes`: the longest dividing prefix of a logical axis's mesh axes, one
  decision for letters that share a logical axis, no mesh axis used twice.
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import jax
import pytest

from kernels_pallas._dispatch import Placement, Rule, split_axes

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kimi_jax" / "model").glob("*.py"))
BACKEND = re.compile(r"(?<![a-z])(cpu|tpu|gpu|cuda|rocm|triton|mosaic)(?![a-z])|native|skinny|default_backend|platform",
                     re.I)


@pytest.mark.parametrize("path", MODEL_FILES)
def test_model_files_have_no_backend_branches(path):
    src = (ROOT / path).read_text()
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.NAME or (tok.type == tokenize.STRING and not re.search(r"\s", tok.string)):
            if BACKEND.search(tok.string):
                bad.append(f"line {tok.start[0]}: {tok.string}")
    assert not bad, f"{path} names backends in its code: {bad}"


def test_the_grep_finds_a_backend_branch():
    """The check above can fail: the code before the op layer had these (layers.py)."""
    src = 'def _default_kda_chunk():\n    return 1 if jax.default_backend() == "cpu" else 64\n'
    names = [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline)
             if t.type in (tokenize.NAME, tokenize.STRING) and BACKEND.search(t.string)]
    assert names == ["default_backend", '"cpu"']


class _Mesh:
    def __init__(self, **shape):
        self.shape = shape


def _leaf(*shape):
    return jax.ShapeDtypeStruct(shape, "float32")


RULES = (("batch", ("data", "expert")), ("heads", ("model",)), ("kv_heads", ("model",)))


def test_split_axes_takes_the_longest_dividing_prefix():
    rule = Rule(args=("BTHK", "BSGK"), out="BTHK", split=(("B", "batch"), ("H", "heads"), ("G", "heads")))
    p = Placement(_Mesh(data=2, expert=4, model=2), RULES)
    assert split_axes(rule, p, (_leaf(8, 3, 4, 16), _leaf(8, 9, 2, 16))) == {
        "B": ("data", "expert"), "H": ("model",), "G": ("model",)}
    # 4 sequences: data x expert = 8 does not divide, data = 2 does
    assert split_axes(rule, p, (_leaf(4, 3, 4, 16), _leaf(4, 9, 2, 16)))["B"] == ("data",)
    # kv heads (1) cannot split: query heads stay whole with them (one decision for H and G)
    assert "H" not in split_axes(rule, p, (_leaf(8, 3, 4, 16), _leaf(8, 9, 1, 16)))


def test_split_axes_never_uses_a_mesh_axis_twice():
    rule = Rule(args=("NE",), out="NE", split=(("N", "batch"), ("E", "expert")))
    p = Placement(_Mesh(data=1, expert=4, model=1), RULES + (("expert", ("expert",)),))
    assert split_axes(rule, p, (_leaf(8, 8),)) == {"N": ("expert",)}
