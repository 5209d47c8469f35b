"""Every Redis client of the three services is built here, so they all authenticate alike.

A password comes from the URL (redis://:pw@host:6379/0) or, when the URL has none, from
REDIS_PASSWORD / --redis-password: in Kubernetes the URL sits in a ConfigMap and the password in
a Secret. rediss:// (TLS) URLs go to redis-py unchanged. The password is never logged; error
messages name the URL without it.
"""
from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from tandem.envflags import add_flag

PASSWORD_ENV = "REDIS_PASSWORD"


def add_password_flag(parser) -> None:
    """--redis-password, defaulting to $REDIS_PASSWORD (prefer the variable: a command line is
    visible to every user of the host in ps)."""
    add_flag(parser, "--redis-password", PASSWORD_ENV, "",
             help="Redis password, used when the --redis-url carries none (prefer the "
                  "environment variable: command lines show in ps)", metavar="PASSWORD")


def client(url: str, password: str | None = None, **kwargs) -> aioredis.Redis:
    """An asyncio Redis client for `url`; `password` applies only when the URL has none
    (redis-py lets the URL's own options win over keyword arguments)."""
    if password:
        kwargs["password"] = password
    return aioredis.Redis.from_url(url, **kwargs)


def redacted(url: str) -> str:
    """`url` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _refused_auth(exc: BaseException) -> bool:
    if isinstance(exc, AuthenticationError):
        return True
    text = str(exc)
    return isinstance(exc, ResponseError) and text.startswith(("NOAUTH", "WRONGPASS"))


async def check_auth(url: str, password: str | None = None) -> None:
    """Fail fast, with a clear ValueError, when Redis refuses our credentials. Any other
    trouble (Redis down, slow) passes: the services ride it out and retry."""
    conn = client(url, password, socket_connect_timeout=2.0, socket_timeout=2.0)
    try:
        await conn.ping()
    except (RedisError, OSError) as exc:
        if _refused_auth(exc):
            how = ("the password was refused" if password or urlsplit(url).password
                   else "it needs a password: set REDIS_PASSWORD (or --redis-password)")
            raise ValueError(f"Redis at {redacted(url)} refused authentication: {how} "
                             f"({type(exc).__name__})") from None
    finally:
        await conn.aclose()
