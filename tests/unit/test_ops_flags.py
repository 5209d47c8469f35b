"""Operations flags every service shares: log level, Redis password, advertise host, API-key
requirement, metrics port, shutdown grace, and `tandem drain`."""
import signal
import subprocess
import sys
import time

import pytest

from tools.cli import build_parser, main

pytestmark = pytest.mark.unit

SERVICES = ("gateway", "verifier", "draft")
SERVICE_ENV = {"gateway": "TANDEM_GATEWAY_LOG_LEVEL", "verifier": "TANDEM_VERIFIER_LOG_LEVEL",
               "draft": "TANDEM_DRAFT_LOG_LEVEL"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("TANDEM_LOG_LEVEL", *SERVICE_ENV.values(), "REDIS_PASSWORD", "TANDEM_API_KEYS",
                 "TANDEM_API_KEYS_FILE", "TANDEM_REQUIRE_API_KEYS",
                 "TANDEM_GATEWAY_METRICS_PORT", "TANDEM_GATEWAY_SHUTDOWN_GRACE_S",
                 "TANDEM_GATEWAY_REQUEST_TIMEOUT", "TANDEM_VERIFIER_ADVERTISE_HOST",
                 "TANDEM_DRAFT_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)


def parse(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("service", SERVICES)
def test_log_level_reads_tandem_log_level_in_any_case(monkeypatch, service):
    assert parse(service).log_level == "info"
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "DEBUG")
    assert parse(service).log_level == "debug"
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "Warning")
    assert parse(service).log_level == "warning"
    assert parse(service, "--log-level", "ERROR").log_level == "error"  # the flag wins


@pytest.mark.parametrize("service", SERVICES)
def test_the_service_specific_variable_wins(monkeypatch, service):
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "debug")
    monkeypatch.setenv(SERVICE_ENV[service], "ERROR")
    assert parse(service).log_level == "error"


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_log_level_is_a_usage_error(monkeypatch, capsys, service):
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "chatty")
    with pytest.raises(SystemExit) as exc:
        parse(service)
    assert exc.value.code == 2 and "chatty" in capsys.readouterr().err


@pytest.mark.parametrize("service", SERVICES)
def test_redis_password_from_env_or_flag(monkeypatch, service):
    assert parse(service).redis_password == ""
    monkeypatch.setenv("REDIS_PASSWORD", "from-env")
    assert parse(service).redis_password == "from-env"
    assert parse(service, "--redis-password", "flag").redis_password == "flag"


@pytest.mark.parametrize("service", SERVICES)
def test_new_flags_show_in_help(capsys, service):
    with pytest.raises(SystemExit):
        parse(service, "--help")
    out = capsys.readouterr().out
    want = {"gateway": ["--require-api-keys", "TANDEM_REQUIRE_API_KEYS", "--metrics-port",
                        "TANDEM_GATEWAY_METRICS_PORT", "--shutdown-grace-s",
                        "TANDEM_GATEWAY_SHUTDOWN_GRACE_S"],
            "verifier": ["--advertise-host", "TANDEM_VERIFIER_ADVERTISE_HOST"],
            "draft": ["--advertise-host", "TANDEM_DRAFT_ADVERTISE_HOST"]}[service]
    for word in ["--log-level", "TANDEM_LOG_LEVEL", "--redis-password", "REDIS_PASSWORD", *want]:
        assert word in out, word


@pytest.mark.parametrize("service", ["verifier", "draft"])
def test_advertise_host_flag_and_env(monkeypatch, service):
    assert parse(service, "--advertise-host", "fd00::1").advertise_host == "fd00::1"
    monkeypatch.setenv(f"TANDEM_{service.upper()}_ADVERTISE_HOST", "10.0.0.9")
    assert parse(service).advertise_host == "10.0.0.9"


def test_require_api_keys_without_a_key_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_REQUIRE_API_KEYS", "true")
    assert main(["gateway", "--model", "/nonexistent"]) == 2  # refused before loading anything
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--require-api-keys" in err[0] and "--api-keys" in err[0]
    assert main(["gateway", "--require-api-keys", "--model", "/nonexistent"]) == 2


def test_require_api_keys_with_keys_passes(monkeypatch, tmp_path):
    from gateway.auth import ApiKey, digest_of
    from gateway.cli import api_keys, build_config

    assert api_keys(parse("gateway", "--require-api-keys", "--api-keys", "k1")) == ("k1",)
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(ApiKey(digest_of("sk-1"), "ops").line() + "\n")
    args = parse("gateway", "--require-api-keys=on", "--api-keys-file", str(keys_file))
    assert [k.name for k in build_config(args, "redis://h:1/0", tmp_path).api_keys] == ["ops"]
    assert api_keys(parse("gateway", "--require-api-keys=off")) == ()


def test_gateway_metrics_port_and_shutdown_grace(monkeypatch, tmp_path):
    from gateway.cli import build_config

    config = build_config(parse("gateway"), "redis://h:1/0", tmp_path)
    assert config.metrics_port == 0 and config.shutdown_grace_s == config.request_timeout_s == 600
    config = build_config(parse("gateway", "--request-timeout", "30"), "redis://h:1/0", tmp_path)
    assert config.shutdown_grace_s == 30  # default: the request timeout
    monkeypatch.setenv("TANDEM_GATEWAY_METRICS_PORT", "9090")
    monkeypatch.setenv("TANDEM_GATEWAY_SHUTDOWN_GRACE_S", "45")
    config = build_config(parse("gateway"), "redis://h:1/0", tmp_path)
    assert config.metrics_port == 9090 and config.shutdown_grace_s == 45
    with pytest.raises(ValueError, match="metrics_port must differ"):
        build_config(parse("gateway", "--port", "9090"), "redis://h:1/0", tmp_path)
    with pytest.raises(ValueError, match="shutdown_grace_s"):
        build_config(parse("gateway", "--shutdown-grace-s", "-1"), "redis://h:1/0", tmp_path)


def test_redis_client_takes_the_password_only_when_the_url_has_none():
    from redis.asyncio.connection import SSLConnection

    from tandem import redis_conn

    kw = redis_conn.client("redis://h:6379/0", "pw").connection_pool.connection_kwargs
    assert kw["password"] == "pw"
    kw = redis_conn.client("redis://:inurl@h:6379/0", "pw").connection_pool.connection_kwargs
    assert kw["password"] == "inurl"
    pool = redis_conn.client("rediss://h:6380/1", "pw").connection_pool
    assert pool.connection_class is SSLConnection  # TLS reaches redis-py unchanged
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["db"] == 1
    assert "password" not in redis_conn.client("redis://h:1/0").connection_pool.connection_kwargs
    assert redis_conn.redacted("rediss://u:secret@h:6380/0") == "rediss://u:***@h:6380/0"
    assert redis_conn.redacted("redis://h:1/0") == "redis://h:1/0"


def test_registration_keeps_the_password_out_of_repr():
    from tandem.registration import Registration
    from verify_service.config import VerifierConfig

    reg = Registration("redis://h:1/0", "draft", "h:2", redis_password="s3cret")
    assert "s3cret" not in repr(reg)
    assert "s3cret" not in repr(VerifierConfig(redis_password="s3cret"))


# ---- tandem drain ----------------------------------------------------------------------------


CHILD = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: (print("SIGUSR1", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)
"""


def test_drain_signals_the_pid_then_sleeps():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        start = time.monotonic()
        assert main(["drain", "--pid", str(child.pid), "--sleep", "0.3"]) == 0
        assert time.monotonic() - start >= 0.3
        assert child.wait(5) == 0 and child.stdout.readline().strip() == "SIGUSR1"
    finally:
        child.kill()
        child.wait()


def test_drain_defaults_are_pid_1_and_5_s():
    args = parse("drain")
    assert (args.pid, args.sleep) == (1, 5.0)
    assert args.func.__module__ == "tandem.drain"


def test_drain_of_a_missing_process_still_sleeps_and_fails(capsys):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is free now (reaped)
    start = time.monotonic()
    assert main(["drain", "--pid", str(child.pid), "--sleep", "0.1"]) == 1
    assert time.monotonic() - start >= 0.1
    assert f"cannot signal pid {child.pid}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--pid", "0"], ["--sleep", "-1"], ["--sleep", "nan"]])
def test_drain_refuses_bad_arguments(argv, capsys):
    assert main(["drain", *argv]) == 2
    assert "tandem: error" in capsys.readouterr().err


def test_drain_signal_is_sigusr1():
    from tandem.drain import DRAIN_SIGNAL

    assert DRAIN_SIGNAL == signal.SIGUSR1


def test_a_drain_signal_during_start_up_is_kept_and_acted_on_once():
    import asyncio
    import os

    from tandem.drain import DrainSignal

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        drain = DrainSignal()
        os.kill(os.getpid(), signal.SIGUSR1)  # still "loading": remembered, not fatal
        assert drain.requested
        began = []

        async def main():
            async def begin():
                began.append(time.monotonic())

            drain.on_loop(begin)  # acts on the early signal at once
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGUSR1)  # a later one changes nothing
            await asyncio.sleep(0.05)

        asyncio.run(main())
        assert len(began) == 1
        calls = []
        DrainSignal().on_signal(lambda: calls.append(1))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_drain_starts_without_the_other_commands_imports():
    """The preStop hook signals at once: `tandem drain` does not import torch (which every
    other command's parser pulls in, ~1.5 s here)."""
    code = ("import sys; from tools.cli import main; "
            "rc = main(['drain', '--pid', '999999999', '--sleep', '0']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["1", "False"], out.stderr
