"""Two processes on localhost (4 CPU devices each, one 8-device mesh through jax.distributed) give the same greedy
tokens as one process, through the test's own greedy loop and through ``kimi_jax.generate``.

The K3 fixture on data=1, expert=2, model=4: the expert axis spans the two processes, so each process reads
only its half of the routed experts (from_pretrained(mesh=...)) and the expert exchange crosses processes (gloo).
"""

import pytest

from tests.sharding_run import multi_process, single_process


@pytest.mark.slow  # the fast set runs the same K3 mesh over two processes through the server (test_serve_multihost)
def test_two_processes_match_one_process():
    results = multi_process("k3:ep2tp4")
    one = single_process()
    want = one["baseline"]["k3"]["tokens"]  # the same prompts on one device, in one process
    assert want == next(c["tokens"] for c in one["cases"] if c["model"] == "k3")  # and on 8 devices in one process
    for i, r in enumerate(results):
        assert r["processes"] == 2 and r["devices"] == 8
        (case,) = r["cases"]
        assert len(case["local_devices"]) == 4
        assert case["tokens"] == want, f"process {i}: {case['tokens']} != {want}"
        assert case["generate_tokens"] == want, f"process {i}, generate(): {case['generate_tokens']} != {want}"
    # each process holds one half of the experts, a different half, and read less than the whole checkpoint
    halves = [r["cases"][0]["expert_slices_here"] for r in results]
    assert all(len(h) == 1 for h in halves) and halves[0] != halves[1], halves
    E = results[0]["cases"][0]["expert_shape"][0]
    assert sorted(tuple(h[0]) for h in halves) == [(0, E // 2), (E // 2, E)]
    for r in results:
        load = r["cases"][0]["load"]
        assert load["expert_bytes_read"] * 2 == load["expert_bytes_total"] > 0, load
        assert load["bytes_read"] < load["bytes_total"], load
