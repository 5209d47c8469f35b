"""API keys, held only as sha256 digests, each with optional per-key quotas.

A key is given to the gateway in plain text (`--api-keys`, hashed at startup) or already hashed
(`sha256:<hex>` in `--api-keys`, or a keys file). The keys file (`--api-keys-file`, e.g. mounted
from a Kubernetes Secret) has one key per line; blank lines and `#` comments are ignored:

    sha256:<64 hex digits> [name] [rpm=N] [tpm=N]

`name` labels the key in logs and errors; `rpm` (requests per minute) overrides the gateway's
`--rate-limit-rpm` for this key (0 = unlimited); `tpm` caps prompt + completion tokens per
minute (0 or absent = unlimited). `tandem keys hash` prints such a line for a key on stdin.

With keys configured, the API's description (/openapi.json, /docs, /redoc) needs one too.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "sha256:"
_HEX = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
OPTIONS = ("rpm", "tpm")


def digest_of(key: str) -> str:
    """The hex sha256 of a plain key: the only form the gateway keeps."""
    return hashlib.sha256(key.encode()).hexdigest()


def _check_quota(name: str, value: int | None, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: its digest (never the key) and its quotas."""

    digest: str  # 64 lowercase hex digits
    name: str = ""  # "" = "key-" and the digest's first 8 hex digits
    rpm: int | None = None  # None = the gateway's --rate-limit-rpm; 0 = unlimited
    tpm: int = 0  # prompt + completion tokens per minute; 0 = unlimited

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not _HEX.fullmatch(self.digest):
            # not echoed: a plain key passed here by mistake must not reach the logs
            raise ValueError("an API key digest must be 64 lowercase hex digits (sha256)")
        if not self.name:
            object.__setattr__(self, "name", f"key-{self.digest[:8]}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"API key name {self.name!r} must be 1-64 characters of "
                             "A-Z a-z 0-9 . _ @ -")
        _check_quota("rpm", self.rpm, optional=True)
        _check_quota("tpm", self.tpm, optional=False)

    @classmethod
    def parse(cls, entry: str) -> ApiKey:
        """`sha256:<hex>` as given, or a plain key, hashed here (its text is not kept)."""
        if not isinstance(entry, str) or not entry or "," in entry \
                or any(c.isspace() for c in entry):
            raise ValueError("api_keys must be non-empty strings without commas or spaces")
        if entry.startswith(PREFIX) and _HEX.fullmatch(entry[len(PREFIX):].lower()):
            return cls(entry[len(PREFIX):].lower())
        return cls(digest_of(entry))

    @property
    def identity(self) -> str:
        """Who rate limits and quotas count (never the key itself)."""
        return "key-" + self.digest[:16]

    def line(self) -> str:
        """This key as a keys-file line."""
        parts = [PREFIX + self.digest, self.name]
        if self.rpm is not None:
            parts.append(f"rpm={self.rpm}")
        if self.tpm:
            parts.append(f"tpm={self.tpm}")
        return " ".join(parts)


def normalize_keys(entries: Iterable[ApiKey | str]) -> tuple[ApiKey, ...]:
    """ApiKeys from a mix of ApiKeys and strings; the same key twice is an error."""
    if isinstance(entries, str):  # iterating it would make every character a key
        raise ValueError("api_keys must be a sequence of keys, not one string")
    keys = tuple(e if isinstance(e, ApiKey) else ApiKey.parse(e) for e in entries)
    seen: dict[str, str] = {}
    for k in keys:
        if k.digest in seen:
            raise ValueError(f"API key {k.name!r} is the same key as {seen[k.digest]!r}")
        seen[k.digest] = k.name
    names = [k.name for k in keys]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"two API keys are named {dup!r}: names must be unique")
    return keys


def match_key(presented: str, keys: Sequence[ApiKey]) -> ApiKey | None:
    """The key whose digest equals the presented key's, compared in constant time against
    every key: no early exit that would tell, by timing, how far down the list it matched."""
    want = digest_of(presented).encode()
    found = None
    for k in keys:
        if hmac.compare_digest(want, k.digest.encode()):
            found = k
    return found


def _parse_line(text: str, where: str) -> ApiKey:
    first, *rest = text.split()
    if not first.startswith(PREFIX) or not _HEX.fullmatch(first[len(PREFIX):].lower()):
        # the token is not echoed: it may be a plain key written here by mistake
        raise ValueError(f"{where}: expected 'sha256:<64 hex digits>' first (a keys file "
                         "holds digests, never plain keys: make one with `tandem keys hash`)")
    name, quotas = "", {}
    for token in rest:
        opt, eq, value = token.partition("=")
        if not eq:
            if name:
                raise ValueError(f"{where}: two names ({name!r} and {token!r}); expected "
                                 "'sha256:<hex> [name] [rpm=N] [tpm=N]'")
            name = token
        elif opt not in OPTIONS:
            raise ValueError(f"{where}: unknown option {opt!r} (expected rpm=N or tpm=N)")
        elif opt in quotas:
            raise ValueError(f"{where}: {opt} is given twice")
        elif not value.isdigit():
            raise ValueError(f"{where}: {opt} must be a whole number >= 0, got {value!r}")
        else:
            quotas[opt] = int(value)
    try:
        return ApiKey(first[len(PREFIX):].lower(), name, quotas.get("rpm"), quotas.get("tpm", 0))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_keys_file(text: str, source: str = "keys file") -> tuple[ApiKey, ...]:
    """Every key of a keys file's text; errors name the source and line."""
    keys = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            keys.append(_parse_line(line, f"{source}, line {number}"))
    if not keys:
        # an empty file must not quietly turn authentication off
        raise ValueError(f"{source} holds no API keys (expected lines "
                         "'sha256:<hex> [name] [rpm=N] [tpm=N]')")
    try:
        return normalize_keys(keys)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_keys_file(path: str | Path) -> tuple[ApiKey, ...]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API keys file {str(path)!r}: {exc}") from None
    return parse_keys_file(text, str(path))


def add_docs(app: Any, guard: Any) -> None:
    """/openapi.json, /docs and /redoc behind `guard` (FastAPI serves its own openly):
    with keys configured they describe the API to key holders only."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import JSONResponse

    @app.get("/openapi.json", include_in_schema=False, dependencies=[guard])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[guard])
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/redoc", include_in_schema=False, dependencies=[guard])
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)


def authenticate(config, request) -> ApiKey | None:
    """The presented key's ApiKey; None when keys are not configured (config: a
    GatewayConfig; request: a Starlette Request)."""
    from gateway.errors import unauthorized

    if not config.auth_enabled:
        return None
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    key = match_key(presented, config.api_keys)
    if key is None:
        raise unauthorized("invalid API key")
    return key


def tenant_of(request) -> str:
    """Who the draft side may keep state for: the key's digest when keys are configured
    (already checked by the gateway's authorization), else anonymous."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    return key.identity if key else ""
