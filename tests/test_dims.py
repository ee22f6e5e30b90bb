"""Dimension letters mean one thing each, and that thing is written down once (``kernels_pallas/dims.py``).

* Every shape-suffixed name in the code (``x_BTD``, ``q_pe_BTHO``: a lowercase prefix, ``_``, 1-6 capitals), read
  as Python tokens (so strings, comments and docstrings do not count), uses only letters of ``dims.LETTERS``.
* The ops' partition rules (letters per operand dimension) use only those letters too, and the MoE gather rule
  splits tokens without splitting the weights' output features (it once named both ``N``).
* The module docstring's table and ``LETTERS`` agree.
"""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import jax
import pytest

from kernels_pallas import dims

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kimi_jax", "kernels_pallas", "convert")
# A lowercase prefix (underscores allowed: q_pe_BTHO), then the shape suffix. ALL_CAPS constants (INT32_MAX,
# _I32_MAX, GMM_RULE) and CamelCase names (A_log) do not match.
SHAPE_NAME = re.compile(r"[a-z][a-z0-9_]*?_([A-Z]{1,6})")
# Names that match SHAPE_NAME but carry no shape, with the reason. None are left today.
NOT_SHAPES: dict[str, str] = {}


def shape_names(source: str) -> list[tuple[int, str, str]]:
    """``(line, name, suffix)`` for every shape-suffixed name token in ``source``."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        m = SHAPE_NAME.fullmatch(tok.string) if tok.type == tokenize.NAME else None
        if m and tok.string not in NOT_SHAPES:
            out.append((tok.start[0], tok.string, m.group(1)))
    return out


def undefined(source: str) -> list[str]:
    """``"line N: name"`` for every shape-suffixed name with a letter missing from ``dims.LETTERS``."""
    return [f"line {line}: {name}" for line, name, suffix in shape_names(source)
            if any(c not in dims.LETTERS for c in suffix)]


SOURCES = sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES)
def test_shape_suffixes_use_defined_letters(path):
    bad = undefined((ROOT / path).read_text())
    assert not bad, f"{path}: letters not in kernels_pallas/dims.py LETTERS: {bad}"


def test_the_letter_check_can_fail():
    """The check above finds an undefined letter in code, and only in code."""
    src = ('def f(x_BTD, y_BTZ):\n'
           '    """Returns z_BTY."""  # and w_NZ in a comment\n'
           '    INT32_MAX, _I32_MAX = 1, 2\n'
           '    return "v_ZZ", q_pe_BTHY\n')
    assert undefined(src) == ["line 1: y_BTZ", "line 4: q_pe_BTHY"]
    assert [n for _, n, _ in shape_names(src)] == ["x_BTD", "y_BTZ", "q_pe_BTHY"]


def test_the_scan_sees_the_code():
    """Guard against a scan that silently finds nothing: the model and kernel names are there."""
    names = {n for path in SOURCES for _, n, _ in shape_names((ROOT / path).read_text())}
    assert {"x_BTD", "state_BHKU", "w_EJI", "q_BGAK", "x_MI"} <= names


def _ops():
    import kernels_pallas.attention as attention
    import kernels_pallas.kda as kda
    import kernels_pallas.matvec as matvec
    import kernels_pallas.mla_decode as mla_decode
    import kernels_pallas.moe_gmm as moe_gmm
    import kernels_pallas.paged_attention as paged_attention
    import kernels_pallas.sparse_mla as sparse_mla
    from kernels_pallas._dispatch import Op

    modules = (attention, kda, matvec, mla_decode, moe_gmm, paged_attention, sparse_mla)
    return {f"{m.__name__}.{k}": v for m in modules
            for k, v in vars(m).items() if isinstance(v, Op)}


def test_partition_rules_use_defined_letters():
    ops = _ops()
    assert len(ops) >= 7
    bad = []
    for name, op in ops.items():
        if op.rule is None:
            continue
        outs = (op.rule.out,) if isinstance(op.rule.out, str) else op.rule.out
        letters = "".join(a for a in op.rule.args if a) + "".join(outs) + "".join(c for c, _ in op.rule.split)
        bad += [f"{name}: {c}" for c in sorted(set(letters)) if c not in dims.LETTERS]
    assert not bad, bad


def test_gather_rule_splits_tokens_not_weights():
    from jax.sharding import PartitionSpec as P

    from kernels_pallas._dispatch import Placement, _spec, split_axes
    from kernels_pallas.moe_gmm import GATHER_RULE

    class _Mesh:
        shape = {"data": 2}

    leaf = lambda *s: jax.ShapeDtypeStruct(s, "float32")  # noqa: E731
    x, w, idx = leaf(4, 2, 8), leaf(6, 8, 8), leaf(4, 2)  # tokens, experts and features all divisible by 2
    split = split_axes(GATHER_RULE, Placement(_Mesh(), (("batch", ("data",)),)), (x, w, idx))
    assert _spec(GATHER_RULE.args[0], split) == P("data", None, None)
    assert _spec(GATHER_RULE.args[1], split) == P(None, None, None)
    assert _spec(GATHER_RULE.out, split) == P("data", None, None)


def test_docstring_table_matches_letters():
    doc = dims.__doc__
    for letter, meaning in dims.LETTERS.items():
        assert re.search(rf"(^|\s){letter}  {re.escape(meaning)}", doc, re.M), f"{letter}: {meaning!r} not in the table"
    listed = re.findall(r"(?:^|\s{2,})([A-Z])  \S", doc, re.M)
    assert sorted(listed) == sorted(dims.LETTERS), "the docstring table lists other letters than LETTERS"
