"""The serving engine's step plans (kimi_jax/serving/stepplan.py) and its one stop-string matcher
(kimi_jax/serving/detokenize.py), without a model: a plan of every op survives the int32 wire form exactly, a buffer
that is not a plan is refused by name, and stop strings split across pushes are found where they start."""

import numpy as np
import pytest

from kimi_jax.serving import stepplan as sp
from kimi_jax.serving.detokenize import StopText


def _every_op():
    return (sp.Admit(3, 0.75, 40, 0.5, 2**32 - 1), sp.SetPages(3, 2, (7, 8, 9)), sp.ClearRow(1),
            sp.Snapshot(3, 12), sp.PutState(2, 12, 45), sp.SpillState(12), sp.DropState(12), sp.CopyPage(4, 5),
            sp.SpillPages(13, (1, 2)), sp.RestorePages(13, (6, 7)), sp.DropPages(13),
            sp.Prefill(3, 32, 64, 4, tuple(range(100, 140))),
            sp.Decode.make(16, [0, 2, 8, 8], [11, 12, 0, 0], [3, 1, 0, 0], [True, True, False, False], all_rows=False,
                           draft=False),
            sp.Verify.make(4, [0, 3, 2], [[11, 5, 6, 0], [0, 0, 0, 0], [12, 7, 0, 0]], [2, 0, 1], [3, 0, 9],
                           [True, False, True], all_rows=False),
            sp.Stop(), sp.Mask.make([2, 0], [[[-1, 0, 5]], [[2**31 - 1, -2**31, 7]]]))


def test_a_plan_of_every_op_round_trips_exactly():
    assert set(type(op) for op in _every_op()) == set(sp.OPS.values())  # every kind of op is in the plan
    plan = sp.StepPlan(2**31 - 1, _every_op())
    data = plan.to_bytes()
    assert sp.StepPlan.from_bytes(data) == plan
    assert sp.StepPlan.from_words(np.frombuffer(data, "<i4")) == plan
    # float sampling values travel as float32 bits: 0.75 and 0.5 are exact there; the seed's top bit survives
    admit = sp.StepPlan.from_bytes(data).ops[0]
    assert (admit.temperature, admit.top_p, admit.seed) == (0.75, 0.5, 2**32 - 1)
    rows, tokens, counts, live = plan.ops[12].columns()
    assert rows.tolist() == [0, 2, 8, 8] and live.tolist() == [True, True, False, False]
    assert sp.StepPlan.from_bytes(data).ops[12].draft == 0 and sp.Decode.make(1, [0], [1], [0], [True], False).draft
    assert plan.compute is plan.ops[11]  # the first compute op: the one whose results the plan returns
    rows, tokens, dlen, counts, live = sp.StepPlan.from_bytes(data).ops[13].columns()
    assert rows.tolist() == [0, 3, 2] and tokens.tolist() == [[11, 5, 6, 0], [0, 0, 0, 0], [12, 7, 0, 0]] and dlen.tolist() == [2, 0, 1]
    assert counts.tolist() == [3, 0, 9] and live.tolist() == [True, False, True]
    # a mask's rows land where named, the others allow every id; int32 words keep every bit
    full = sp.StepPlan.from_bytes(data).ops[15].full(4)
    assert full[:, 0].tolist() == [[2**31 - 1, -2**31, 7], [-1, -1, -1], [-1, 0, 5], [-1, -1, -1]]


def test_a_decode_plan_is_small():
    """What a busy engine sends per step: a decode over 64 slots, a page for each, is a few hundred int32 words."""
    ops = tuple(sp.SetPages(i, 10, (100 + i,)) for i in range(64))
    ops += (sp.Decode.make(16, list(range(64)), [5] * 64, [9] * 64, [True] * 64, all_rows=True),)
    assert len(sp.StepPlan(7, ops).to_words()) == 3 + 64 * 5 + 5 + 4 * 64  # a decode: code, size, 3 fields, table


@pytest.mark.parametrize("words,fragment", [
    ([1, 2, 3], "bad magic"),
    ([sp.MAGIC, 0, 9, 1], "plan of 9 words in a buffer of 4"),
    ([sp.MAGIC, 0, 5, 99, 2], "unknown op code 99"),
    ([sp.MAGIC, 0, 6, 4, 3, 1], "Snapshot: 1 words, needs at least 2"),
    ([sp.MAGIC, 0, 8, 4, 5, 1, 2, 3], "Snapshot: 3 words, expected 2"),
    ([sp.MAGIC, 0, 5, 4, 9], "claims 9 words"),
])
def test_a_buffer_that_is_not_a_plan_is_refused(words, fragment):
    with pytest.raises(sp.PlanError, match=fragment):
        sp.StepPlan.from_words(np.asarray(words, np.int64).astype(np.int32))
    with pytest.raises(sp.PlanError, match="whole int32 words"):
        sp.StepPlan.from_bytes(b"\x00" * 7)


def test_shapes_buckets():
    sh = sp.Shapes(slots=8, max_len=2048, page_size=64, n_pages=100, chunk=256, min_chunk=64, snapshot_every=256)
    assert sh.buckets == (64, 128, 256) and sh.widths == (1, 4, 16, 32) and sh.row_buckets == (1, 4, 8)
    assert sh.fresh_width == 4 and sh.bucket(65) == 128 and sh.width(5) == 16 and sh.rows(5) == 8


def test_stop_strings_across_pushes():
    s = StopText(["END", "xy"])
    out = [s.push(t) for t in ("abE", "N", "Dzz")]
    assert "".join(o for o, _ in out) == "ab" and out[-1][1]  # held back until it could no longer be a stop
    s = StopText(["END"])
    assert s.push("aEN") == ("a", False) and s.push("x") == ("E", False) and s.flush() == "Nx"
    s = StopText([])
    assert s.push("anything") == ("anything", False)
