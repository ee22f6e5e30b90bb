"""Reading compiled HLO text: which collectives feed which kernel.

A Pallas kernel on a mesh should receive its operands as its op's partition rule splits them
(``kernels_pallas/_dispatch.py``). Had GSPMD partitioned the kernel itself, it would all-gather the sharded
operands first. :func:`gathers_into_kernels` walks back from every kernel call through the data-movement ops that
sit between a producer and its consumer (copies, reshapes, element-wise and index fusions) and reports the
all-gathers it meets; the walk stops at parameters, matrix products and other kernels, whose own inputs are
another op's business.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"^(?:\([^=]*?\)|\S+) ([\w\-]+)\(")
_STOP = ("parameter", "dot", "convolution", "while", "conditional", "custom-call")


def _parse(text: str):
    instrs, comp_of, comp_gathers = {}, {}, defaultdict(bool)
    comp = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and " = " not in line.split("{")[0]:
            comp = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OP.match(rest)
        op = op.group(1) if op else ""
        body = rest.split("), ", 1)[0]
        operands = re.findall(r"%([\w.\-]+)", body)
        calls = re.findall(r"(?:calls|to_apply|called_computations)=\{?%([\w.\-]+)", rest)
        instrs[name] = dict(op=op, operands=operands, calls=calls, line=rest)
        comp_of[name] = comp
        if op.startswith("all-gather"):
            comp_gathers[comp] = True
    return instrs, comp_gathers


def _is_gather(ins, comp_gathers) -> bool:
    return ins["op"].startswith("all-gather") or any(comp_gathers[c] for c in ins["calls"]
                                                     if ins["op"].startswith("async"))


def _stops(ins) -> bool:
    # matrix-product fusions: kOutput on TPU, kCustom (Triton / cuBLAS GEMMs) on GPU
    matmul = "kind=kOutput" in ins["line"] or "kind=kCustom" in ins["line"]
    return ins["op"] in _STOP or (ins["op"] == "fusion" and matmul)


def _gathered_elements(ins) -> int:
    """Elements of an all-gather's result (the last array of a tuple-typed async start); 0 if unreadable."""
    head = ins["line"].split(f" {ins['op']}(", 1)[0]
    dims = re.findall(r"\w+\[([\d,]*)\]", head)
    return math.prod(int(d) for d in dims[-1].split(",") if d) if dims else 0


def gathers_into_kernels(text: str, marker: str, sizes: bool = False) -> dict[str, int | list[int]]:
    """``kernel:call`` (``kda_recurrent:kda_recurrent.6``) -> all-gathers feeding it, for every custom call whose target
    contains ``marker`` (``tpu_custom_call`` / ``__gpu$xla.gpu.triton``); with ``sizes``, the element counts of
    their results instead of their number."""
    instrs, comp_gathers = _parse(text)
    out = {}
    for name, ins in instrs.items():
        if ins["op"] != "custom-call" or marker not in ins["line"]:
            continue
        seen, stack, found = set(), list(ins["operands"]), []
        while stack:
            cur = stack.pop()
            if cur in seen or cur not in instrs:
                continue
            seen.add(cur)
            node = instrs[cur]
            if _is_gather(node, comp_gathers):
                found.append(_gathered_elements(node))
            if not _stops(node):
                stack.extend(node["operands"])
        out[f"{_kernel_name(ins['line']) or name}:{name}"] = found if sizes else len(found)
    return out


def _kernel_name(line: str) -> str | None:
    """The Pallas kernel's name, from the op_name metadata (``.../kda_chunked/pallas_call``) or the call's name."""
    m = re.search(r'op_name="[^"]*?([\w.]+)/pallas_call"', line)
    return m.group(1) if m else None
