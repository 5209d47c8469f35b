"""`tandem up` keeps every child running (tools/launcher.py, tools/supervisor.py): a verifier,
the gateway, a draft worker or Redis that exits is started again with backoff, and one that
keeps dying stops the cluster with a message naming it. Real (cheap) child processes, started
through the launcher's own spawn and restart path."""
import subprocess
import sys

import pytest

from tools.launcher import Cluster, ClusterConfig
from tools.supervisor import ClusterFailed, RestartPolicy

pytestmark = pytest.mark.unit
SLEEP = "import time; time.sleep(60)"


def cluster_of(monkeypatch, code: str, names=("verifier-0", "gateway", "draft-0"),
               policy: RestartPolicy | None = None):
    """A Cluster whose children run `code` instead of `tandem <role>`; its logs in .lines."""
    lines: list[str] = []
    cluster = Cluster(ClusterConfig(num_drafts=1), log=lines.append)
    cluster.lines = lines
    cluster.started = []
    if policy is not None:
        cluster.policy = policy

    def popen(args):
        cluster.started.append(args)
        return subprocess.Popen([sys.executable, "-c", code])

    monkeypatch.setattr(cluster, "_popen", popen)
    for name in names:
        cluster._spawn(name, [name.split("-")[0], "--port", "1"])
    return cluster


def kill(cluster, name: str) -> subprocess.Popen:
    proc = dict(cluster.procs)[name]
    proc.kill()
    proc.wait()
    return proc


def test_a_dead_verifier_and_gateway_are_started_again_with_backoff(monkeypatch):
    cluster = cluster_of(monkeypatch, SLEEP)
    try:
        now = [0.0]
        first = kill(cluster, "verifier-0")
        kill(cluster, "gateway")
        assert cluster.supervise(lambda: now[0]) == ["verifier-0", "gateway"]  # at once
        assert cluster.started[-2:] == [["verifier", "--port", "1"], ["gateway", "--port", "1"]]
        procs = dict(cluster.procs)
        assert procs["verifier-0"] is not first and procs["verifier-0"].poll() is None
        assert procs["gateway"].poll() is None and procs["draft-0"].poll() is None
        assert any("verifier-0 exited with code -9; starting it again" in m
                   for m in cluster.lines)
        kill(cluster, "verifier-0")
        now[0] = 0.5
        assert cluster.supervise(lambda: now[0]) == []  # backing off: 1 s after the first
        now[0] = 1.0
        assert cluster.supervise(lambda: now[0]) == ["verifier-0"]
        assert cluster.supervise(lambda: now[0]) == []  # running again: nothing to do
    finally:
        cluster.stop()


def test_our_redis_is_restarted_by_the_same_policy(monkeypatch):
    class DeadRedis:
        password, restarts, running = "pw", 0, False

        def is_running(self):
            return self.running

        def restart(self):
            self.restarts += 1
            self.running = True

    cluster = cluster_of(monkeypatch, SLEEP, names=())
    cluster.redis = DeadRedis()
    assert cluster.supervise(lambda: 0.0) == ["redis-server"]
    assert cluster.redis.restarts == 1 and cluster.supervise(lambda: 0.0) == []


def test_a_child_that_keeps_dying_stops_the_cluster_with_a_clear_message(monkeypatch):
    policy = RestartPolicy(first_s=0.01, max_s=0.01, max_restarts=2, window_s=60.0)
    cluster = cluster_of(monkeypatch, "import sys; sys.exit(3)", names=("verifier-0",),
                         policy=policy)
    try:
        with pytest.raises(ClusterFailed) as err:
            cluster.wait()  # what `tandem up` runs: restarts twice, then gives up
    finally:
        cluster.stop()
    assert len(cluster.started) == 3
    assert "verifier-0 exited with code 3" in str(err.value)
    assert "restarted 2 times in the last 60 s" in str(err.value)


def test_a_child_quiet_for_a_whole_window_starts_from_the_first_backoff():
    policy = RestartPolicy(first_s=1.0, max_s=30.0, max_restarts=3, window_s=100.0)
    assert [policy.restarting("v", t, "died") for t in (0.0, 1.0, 3.0)] == [1, 2, 3]
    with pytest.raises(ClusterFailed):
        policy.restarting("v", 50.0, "died")  # a fourth within 100 s
    assert policy.restarting("v", 500.0, "died") == 1  # long after: 1 s again, not 8 s
    assert not policy.ready("v", 500.5) and policy.ready("v", 501.0)


def test_tandem_up_ends_with_one_line_and_status_1_when_a_child_keeps_dying(monkeypatch,
                                                                            capsys):
    import signal

    import tools.launcher
    from tools.cli import main

    class Failing:
        stopped = False
        gateway_url = "http://127.0.0.1:1"

        def __init__(self, config, log):
            pass

        def start(self):
            pass

        def wait(self):
            raise ClusterFailed("verifier-0 exited with code 1 and was already restarted 5 "
                                "times in the last 600 s; stopping the cluster")

        def stop(self):
            Failing.stopped = True

    monkeypatch.setattr(tools.launcher, "Cluster", Failing)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's SIGTERM
    assert main(["up", "--drafts", "0"]) == 1
    err = capsys.readouterr().err
    assert "tandem up: verifier-0 exited with code 1" in err and "Traceback" not in err
    assert Failing.stopped


def test_verifiers_on_one_host_share_its_cores(monkeypatch):
    """One verifier takes torch's default (every core); several split the cores between
    them instead of each taking all of them; --verifier-threads is kept as given."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert ClusterConfig().verifier_thread_count() == 0
    assert ClusterConfig(num_verifiers=2).verifier_thread_count() == 4
    assert ClusterConfig(num_verifiers=3).verifier_thread_count() == 2
    assert ClusterConfig(num_verifiers=16).verifier_thread_count() == 1
    assert ClusterConfig(num_verifiers=2, verifier_threads=3).verifier_thread_count() == 3
