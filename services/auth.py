"""Who is calling the gateway: opaque bearer tokens, stored as SHA-256 hashes.

A **token** is ``apt_`` followed by 43 URL-safe characters (32 random bytes from
:mod:`secrets`). The client sends it as ``Authorization: Bearer <token>``. The
gateway never stores it: its **credentials file** holds one line per token
with the token's SHA-256 and the **principal** the token stands for (a budget
owner's name such as ``alice``, or ``admin``). The gateway takes the actor of
every input it publishes from that principal, never from the request body.

The credentials file is TOML with a single ``[tokens]`` table, one token a
line (a comment after the line says when it was issued)::

    # apportion gateway credentials: ...
    version = 1

    [tokens]
    "sha256:9f86d081884c7d65...0f00a08" = "alice"  # issued 2025-01-02T03:04:05Z

- issue: :func:`issue_token` (``apportion auth issue PRINCIPAL --file F``)
  appends a line and returns the token once;
- rotate: issue a new token for the same principal, hand it out, then revoke
  the old one (a principal may hold several tokens at once);
- revoke: delete the token's line (:func:`revoke_tokens`, ``apportion auth
  revoke``). The gateway re-reads the file whenever it changes (size, mtime or
  inode), so issuing and revoking need no restart.

Verification hashes the presented token and looks the hash up in a dict: no
comparison of secrets byte by byte. How long the lookup takes depends only on
the SHA-256 of what the caller sent, which tells an attacker nothing about
any valid token (the stored keys are hashes of 256-bit random secrets).

:class:`Authenticator` is the seam for other mechanisms: anything with
``authenticate(headers) -> principal`` (raising :class:`AuthError`) and a
``challenge`` for ``WWW-Authenticate`` can guard the gateway. Single sign-on
(an OIDC identity provider's JWTs, verified against its JWKS with a maintained
library such as PyJWT, with ``iss``/``aud``/``exp`` checked and a claim mapped
to the principal) would be one more implementation; nothing else changes.

:func:`ensure_local_credentials` makes the local credentials ``apportion up``
uses; :func:`client_token` finds the token a client sends.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import os
import re
import secrets
import tempfile
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from apportion.schemas.bounds import MAX_NAME_LEN, NAME_CHARS

TOKEN_PREFIX = "apt_"
TOKEN_ENV = "APPORTION_TOKEN"
"""The token itself, for a client."""
TOKEN_FILE_ENV = "APPORTION_TOKEN_FILE"
"""A file holding the token, for a client."""
CREDENTIALS_ENV = "APPORTION_CREDENTIALS"
"""The gateway's credentials file (``apportion serve gateway``, ``apportion auth``)."""

CREDENTIALS_DIR = "credentials"
"""Under ``apportion up``'s data dir: the credentials file and one token file per principal."""
CREDENTIALS_FILE = "tokens.toml"
ADMIN = "admin"
"""The principal of the demo cluster's root owner; a client's last default token is its."""
DEFAULT_DATA_DIR = Path(".apportion")
"""``apportion up``'s default data dir (relative to where it runs)."""

REALM = "apportion"
MAX_TOKEN_LEN = 512
_HASH_KEY = re.compile(r"sha256:[0-9a-f]{64}")
_PRINCIPAL = re.compile(f"[{NAME_CHARS}]{{1,{MAX_NAME_LEN}}}")
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")  # RFC 6750 b64token
_HEADER = """\
# apportion gateway credentials: one line per bearer token,
#   "sha256:<SHA-256 of the token, hex>" = "<principal>"
# The tokens themselves are not stored here. Revoke a token by deleting its line;
# the gateway reads this file again when it changes. Issue: apportion auth issue.
version = 1

[tokens]
"""


class AuthError(Exception):
    """The request is not authenticated (answered 401).

    ``error`` is the RFC 6750 error code for ``WWW-Authenticate``
    (``invalid_request``, ``invalid_token``), or ``None`` when no credential
    was presented at all."""

    def __init__(self, reason: str, error: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class CredentialsError(ValueError):
    """A credentials or token file that cannot be read or is malformed."""


class Authenticator(Protocol):
    """Turns a request's headers into a principal (the seam for SSO: see the module doc)."""

    challenge: str
    """The ``WWW-Authenticate`` value of a 401 (``Bearer realm="apportion"``)."""

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The principal the request's credential stands for; raises :class:`AuthError`."""
        ...


# -- tokens -------------------------------------------------------------------


def new_token() -> str:
    """A fresh token: ``apt_`` and 32 random bytes, URL-safe base64."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The credentials file's key for ``token``: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_principal(principal: str) -> str:
    """``principal`` if it is a name the events can carry (letters, digits, ``_.:@+-``,
    1 to 128 characters, not ``.`` or ``..``); else :class:`ValueError`."""
    if not _PRINCIPAL.fullmatch(principal) or principal in (".", ".."):
        raise ValueError(
            f"bad principal {principal!r}: 1 to {MAX_NAME_LEN} letters, digits or '_.:@+-'"
        )
    return principal


def reserved_principal_error(principal: str) -> str | None:
    """Why no gateway token may stand for ``principal``, or ``None``: ``scheduler``
    (the live scheduler's own inputs, e.g. marking a silent node down) and
    ``agent:<host>`` (a host's agent) are identities the gateway must never stamp."""
    if principal == "scheduler" or principal.startswith("agent:"):
        return (
            f"principal {principal!r} is reserved for the scheduler and host agents; "
            "no gateway token may stand for it"
        )
    return None


def bearer_token(headers: Mapping[str, str]) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; :class:`AuthError` if
    there is none or it is malformed."""
    value = headers.get("Authorization")
    if not value:
        raise AuthError("this request needs a credential: send 'Authorization: Bearer <token>'")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError(
            "the Authorization header must be 'Bearer <token>'", error="invalid_request"
        )
    if len(token) > MAX_TOKEN_LEN or not _TOKEN_CHARS.fullmatch(token):
        raise AuthError("malformed bearer token", error="invalid_token")
    return token


# -- the credentials file -------------------------------------------------------


def parse_credentials(text: str, where: str = "credentials") -> dict[str, str]:
    """``{"sha256:<hex>": principal}`` from a credentials file's text."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CredentialsError(f"{where}: TOML syntax: {exc}") from None
    unknown = set(doc) - {"version", "tokens"}
    if unknown:
        raise CredentialsError(f"{where}: unknown keys {sorted(unknown)} (expected [tokens])")
    if doc.get("version", 1) != 1:
        raise CredentialsError(f"{where}: unsupported version {doc['version']!r}")
    tokens = doc.get("tokens", {})
    if not isinstance(tokens, dict):
        raise CredentialsError(f"{where}: [tokens] must be a table")
    out: dict[str, str] = {}
    for key, principal in tokens.items():
        if not _HASH_KEY.fullmatch(key):
            raise CredentialsError(f"{where}: {key!r} is not 'sha256:' and 64 hex digits")
        if not isinstance(principal, str):
            raise CredentialsError(f"{where}: {key[:15]}...: the principal must be a string")
        try:
            out[key] = check_principal(principal)
        except ValueError as exc:
            raise CredentialsError(f"{where}: {exc}") from None
    return out


def load_credentials(path: str | Path) -> dict[str, str]:
    """The credentials file at ``path`` as ``{"sha256:<hex>": principal}``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(
            f"cannot read the credentials file {path}: {exc.strerror or exc}"
        ) from None
    return parse_credentials(text, str(path))


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, readable by the owner only (0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock`` while the credentials file is rewritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _HEADER
    except OSError as exc:
        raise CredentialsError(f"cannot read {path}: {exc.strerror or exc}") from None


def issue_token(path: str | Path, principal: str) -> str:
    """A new token for ``principal``: its hash is appended to the credentials file
    (created, mode 0600, if missing); the token is returned and stored nowhere."""
    path = Path(path)
    check_principal(principal)
    reserved = reserved_principal_error(principal)
    if reserved:
        raise ValueError(reserved)
    token = new_token()
    with _locked(path):
        text = _read_text(path)
        parse_credentials(text, str(path))  # never append to a file we cannot read back
        if text and not text.endswith("\n"):
            text += "\n"
        if "tokens" not in tomllib.loads(text):  # an empty file, or only `version`
            text += "\n[tokens]\n" if text.strip() else _HEADER
        issued = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text += f'"{hash_token(token)}" = "{principal}"  # issued {issued}\n'
        parse_credentials(text, str(path))
        _write_private(path, text)
    return token


def revoke_tokens(path: str | Path, principal: str, hash_prefix: str = "") -> int:
    """Delete the lines of ``principal``'s tokens (only those whose hash starts with
    ``hash_prefix``, ``sha256:`` optional, when given). Returns how many went."""
    path = Path(path)
    prefix = hash_prefix if hash_prefix.startswith("sha256:") else "sha256:" + hash_prefix
    with _locked(path):
        text = _read_text(path)
        known = parse_credentials(text, str(path))
        gone = {h for h, p in known.items() if p == principal and h.startswith(prefix)}
        if not gone:
            return 0
        kept = [
            line
            for line in text.splitlines(keepends=True)
            if not any(line.lstrip().startswith(f'"{h}"') for h in gone)
        ]
        text = "".join(kept)
        left = parse_credentials(text, str(path))
        if set(known) - set(left) != gone:
            raise CredentialsError(f"{path}: could not remove the lines of {principal!r}")
        _write_private(path, text)
    return len(gone)


class TokenAuthenticator:
    """Bearer tokens checked against a credentials file, read again when it changes.

    A file that cannot be read or parsed refuses every request (the error
    propagates: the gateway answers 500 and logs it) rather than accepting any."""

    challenge = f'Bearer realm="{REALM}"'

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._hashes: dict[str, str] = {}
        self._reload()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise CredentialsError(
                f"cannot read the credentials file {self.path}: {exc.strerror or exc}"
            ) from None
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen != self._seen:
            self._hashes = load_credentials(self.path)
            self._seen = seen

    @property
    def principals(self) -> set[str]:
        return set(self._hashes.values())

    def authenticate(self, headers: Mapping[str, str]) -> str:
        token = bearer_token(headers)
        self._reload()
        principal = self._hashes.get(hash_token(token))
        if principal is None:
            raise AuthError("unknown or revoked token", error="invalid_token")
        return principal


# -- local credentials (apportion up) -------------------------------------------


def credentials_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / CREDENTIALS_DIR


def credentials_file(data_dir: str | Path) -> Path:
    """The credentials file ``apportion up`` keeps under ``data_dir``."""
    return credentials_dir(data_dir) / CREDENTIALS_FILE


def token_file(data_dir: str | Path, principal: str) -> Path:
    """Where ``apportion up`` keeps ``principal``'s token: ``<data_dir>/credentials/<principal>.token``."""
    return credentials_dir(data_dir) / f"{check_principal(principal)}.token"


def read_token_file(path: str | Path) -> str:
    """The token in a token file (its first line; surrounding whitespace ignored)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    token = (text.strip().splitlines() or [""])[0].strip()
    if not token:
        raise CredentialsError(f"token file {path} is empty")
    return token


def write_token_file(path: str | Path, token: str) -> Path:
    """Write ``token`` to ``path``, readable by the owner only (mode 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_private(path, token + "\n")
    return path


def ensure_local_credentials(data_dir: str | Path, principals: Iterable[str]) -> dict[str, Path]:
    """One token per principal under ``<data_dir>/credentials`` (``<principal>.token``,
    mode 0600, in a 0700 folder), their hashes in ``tokens.toml`` there.

    Idempotent: a token file whose token the credentials file still maps to its
    principal is kept; a missing one, or one whose line was deleted (revoked),
    gets a new token. Other lines of the credentials file are left alone.
    Returns ``{principal: token file}`` in the order given."""
    folder = credentials_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    hashes = credentials_file(data_dir)
    if not hashes.exists():
        with _locked(hashes):
            if not hashes.exists():
                _write_private(hashes, _HEADER)
    known = load_credentials(hashes)
    out: dict[str, Path] = {}
    for principal in principals:
        if principal in out:
            continue
        path = token_file(data_dir, principal)
        current = None
        with contextlib.suppress(CredentialsError):
            current = read_token_file(path)
        if current is None or known.get(hash_token(current)) != principal:
            write_token_file(path, issue_token(hashes, principal))
        else:
            os.chmod(path, 0o600)
        out[principal] = path
    return out


def tree_principals(budget: Iterable[tuple[str, int, str]]) -> list[str]:
    """The principals of a budget tree ``(path, weight, owner)``: the root's owner
    first (the admin; :data:`ADMIN` if the root has none), then every other
    owner in tree order, each once."""
    nodes = list(budget)
    root = next((owner for path, _w, owner in nodes if path == "" and owner), ADMIN)
    out = [root]
    for _path, _w, owner in nodes:
        if owner and owner not in out:
            out.append(owner)
    return out


# -- the client's token -----------------------------------------------------------


def default_token_files(cwd: Path | None = None) -> list[Path]:
    """Where a client looks last: ``$XDG_CONFIG_HOME/apportion/token`` (else
    ``~/.config/apportion/token``), then the admin token of an ``apportion up``
    run here with its default data dir (``.apportion/credentials/admin.token``)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    here = cwd or Path.cwd()
    return [Path(config) / "apportion" / "token", here / token_file(DEFAULT_DATA_DIR, ADMIN)]


def client_token(token_file: str | Path | None = None) -> tuple[str | None, str]:
    """The token a client sends and where it came from, in this order:
    ``token_file`` (``--token-file``), ``$APPORTION_TOKEN``, ``$APPORTION_TOKEN_FILE``,
    then :func:`default_token_files`. ``(None, "")`` when there is none; a file
    named explicitly that cannot be read is a :class:`CredentialsError`."""
    if token_file is not None:
        return read_token_file(token_file), f"--token-file {token_file}"
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token, f"${TOKEN_ENV}"
    named = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if named:
        return read_token_file(named), f"${TOKEN_FILE_ENV} ({named})"
    for path in default_token_files():
        if path.is_file():
            with contextlib.suppress(CredentialsError):
                return read_token_file(path), str(path)
    return None, ""
