"""The load A/B's arm order (tools/bench/load_ab.py), without a cluster: every arm goes first
equally often, and no arm always follows the same one (what an arm leaves behind, a busy
draft worker or a learnt step curve, must not always land on one neighbour)."""
import pytest

from tools.bench.load_ab import arm_order

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [2, 3, 6])
def test_each_arm_goes_first_equally_often_and_follows_more_than_one(n):
    arms = [f"m{i}" for i in range(n)]
    orders = [arm_order(arms, rep) for rep in range(2 * n)]
    assert all(sorted(o) == arms for o in orders)  # every arm once per rep
    firsts = [o[0] for o in orders]
    assert all(firsts.count(a) == 2 for a in arms)
    if n > 2:
        for a in arms:
            before = {o[o.index(a) - 1] for o in orders if o.index(a) > 0}
            assert len(before) >= 2, a


def test_cpu_by_role_counts_a_child_under_its_role_and_the_client_apart():
    """proc_cpu reads /proc: a child whose command line says `tools.cli verifier` shows the CPU
    it spent under `verifier`, and the calling process its own under `client`."""
    import subprocess
    import sys
    import time

    from tools.bench.proc_cpu import by_role, cpu_s

    spin = ("import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", spin, "-m", "tools.cli", "verifier"])
    try:
        deadline = time.monotonic() + 30
        while cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = by_role([child.pid])
        assert got["verifier"] >= 0.3 and got["client"] > 0
        assert by_role([]).keys() == {"client"}
    finally:
        child.kill()
        child.wait()


def test_bodies_are_seeded_per_session_when_sampled_and_end_at_eos_when_natural():
    """Sampled arms must draw the same answers (a seed per session, the same in every arm);
    --natural lets answers end at EOS, the default makes every method do the same work."""
    from tools.bench.load_ab import bodies

    prompts = [{"prompt": f"p{i}"} for i in range(3)]
    greedy = bodies(prompts, 4, "ngram", 32, offset=2)
    assert [b["messages"][0]["content"] for b in greedy] == ["p2", "p0", "p1", "p2"]
    assert all(b["ignore_eos"] and "seed" not in b and b["temperature"] == 0.0 for b in greedy)
    sampled = bodies(prompts, 4, "eagle", 32, offset=2, temperature=0.7, natural=True)
    assert [b["seed"] for b in sampled] == [2, 3, 4, 5]
    assert not any(b["ignore_eos"] for b in sampled)
    assert sampled[0]["speculation"]["method"] == "eagle" and sampled[0]["max_tokens"] == 32


def test_reps_that_leave_the_order_unbalanced_are_named():
    """Only a multiple of twice the arms turns the order evenly (arm_order); a 6-rep run of
    6 arms kept each arm's predecessor, and load_ab says so rather than reporting it plainly."""
    from tools.bench.load_ab import unbalanced

    assert unbalanced(12, 6) == "" and unbalanced(24, 6) == "" and unbalanced(3, 1) == ""
    assert "multiple of 12" in unbalanced(6, 6)
    assert unbalanced(8, 4) == "" and unbalanced(10, 4) != ""
    arms = ["a", "b", "c"]
    firsts = [arm_order(arms, rep)[0] for rep in range(6)]
    assert all(firsts.count(a) == 2 for a in arms)  # 6 = 2 x 3 reps: balanced, as it says
