"""Proofs of membership for mpidist's listeners: a job key, and what proves a peer holds it.

Every listener mpidist opens for a job (its ``TCPStore`` server, the PMI server
of a world formed without a launcher) runs a challenge-response before it acts
on anything a peer sends: the client sends a fresh nonce, the server answers
with its own nonce and a proof over both, the client checks it and answers with
its proof. A proof is made with the job's key, which never crosses the wire:

* :class:`SecretKey`: HMAC-SHA256 with a per-job secret (made by rank 0 and sent
  over MPI, given by ``mpidistrun``, or read from ``MPIDIST_SECRET`` /
  ``MPIDIST_SECRET_FILE``);
* :class:`MungeKey`: a munge credential over the proof's digest, which proves the
  peer runs as this user (Slurm clusters run munge; the tasks of an ``srun``
  step need nothing they could only learn by talking first).

Each side proves itself over both nonces with its own role in the message, so a
proof cannot be replayed on another connection nor reflected back to its maker.

Example::

    >>> key = SecretKey(new_secret())
    >>> t = transcript(b"store", key.kind, b"c" * 32, b"s" * 32)
    >>> key.verify(b"server", t, key.prove(b"server", t))
    True
    >>> key.verify(b"client", t, key.prove(b"server", t))
    False
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import hmac
import os
import secrets
import stat
from typing import Mapping

__all__ = [
    "JobKey",
    "SecretKey",
    "MungeKey",
    "NONCE_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "new_secret",
    "new_nonce",
    "transcript",
    "as_key",
    "secret_from_env",
    "munge_key",
]

#: the length of every nonce (bytes)
NONCE_BYTES = 32
#: the least length of a secret the user gives (bytes)
_MIN_SECRET_BYTES = 16
#: the environment variables that give a world started by hand its secret
SECRET_ENV, SECRET_FILE_ENV = "MPIDIST_SECRET", "MPIDIST_SECRET_FILE"


def new_secret() -> bytes:
    """Return a fresh 32-byte job secret."""
    return secrets.token_bytes(32)


def new_nonce() -> bytes:
    """Return a fresh nonce (:data:`NONCE_BYTES` bytes)."""
    return secrets.token_bytes(NONCE_BYTES)


def transcript(service: bytes, kind: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What both proofs of one connection are made over: the service, the key's kind, both nonces."""
    return b"mpidist-auth-1|" + service + b"|" + kind.encode() + b"|" + client_nonce + server_nonce


class JobKey:
    """What a job's members prove they hold (an interface: :class:`SecretKey`, :class:`MungeKey`)."""

    #: the kind named in the handshake (both ends must use the same)
    kind = ""

    def prove(self, role: bytes, message: bytes) -> bytes:
        """Return the proof that ``role`` (``b"client"``/``b"server"``) holds the key, over ``message``."""
        raise NotImplementedError

    def verify(self, role: bytes, message: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is ``role``'s proof over ``message`` (never raises on bad input)."""
        raise NotImplementedError


class SecretKey(JobKey):
    """HMAC-SHA256 with a shared secret.

    Args:
        secret: the job's secret (at least 16 bytes).

    Example::

        >>> key = SecretKey(b"0123456789abcdef")
        >>> len(key.prove(b"client", b"message"))
        32
    """

    kind = "hmac"

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"SecretKey: the secret must be at least {_MIN_SECRET_BYTES} bytes")
        self._secret = secret

    def __repr__(self) -> str:  # never the secret itself
        return "SecretKey(<hidden>)"

    @property
    def secret(self) -> bytes:
        """The secret (to hand to a process this one starts; never log it)."""
        return self._secret

    def prove(self, role: bytes, message: bytes) -> bytes:
        return hmac.new(self._secret, role + b"|" + message, hashlib.sha256).digest()

    def verify(self, role: bytes, message: bytes, proof: bytes) -> bool:
        return isinstance(proof, bytes) and hmac.compare_digest(self.prove(role, message), proof)


class MungeKey(JobKey):
    """Proofs as munge credentials: the peer runs as this user (munged vouches for its uid).

    A proof is a credential whose payload is the digest of the role and message,
    made by libmunge (the library beside ``munged``) and decodable only by this
    user. Checking one asks munged, which refuses a credential it decoded before.

    Example::

        >>> key = munge_key()      # None where munged does not answer
    """

    kind = "munge"

    def __init__(self, lib: ctypes.CDLL, libc: ctypes.CDLL) -> None:
        self._lib, self._libc = lib, libc
        self._uid = os.geteuid()

    def __repr__(self) -> str:
        return f"MungeKey(uid={self._uid})"

    def prove(self, role: bytes, message: bytes) -> bytes:
        digest = hashlib.sha256(b"mpidist-munge|" + role + b"|" + message).digest()
        return self._encode(digest)

    def verify(self, role: bytes, message: bytes, proof: bytes) -> bool:
        if not isinstance(proof, bytes) or not proof or len(proof) > 4096 or b"\0" in proof:
            return False
        decoded = self._decode(proof)
        if decoded is None:
            return False
        payload, uid = decoded
        expected = hashlib.sha256(b"mpidist-munge|" + role + b"|" + message).digest()
        return uid == self._uid and hmac.compare_digest(payload, expected)

    def _encode(self, payload: bytes) -> bytes:
        lib = self._lib
        ctx = lib.munge_ctx_create()
        if not ctx:
            raise OSError("munge: cannot create a context")
        try:
            lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(_MUNGE_OPT_UID_RESTRICTION), ctypes.c_uint(self._uid))
            cred = ctypes.c_char_p()
            err = lib.munge_encode(ctypes.byref(cred), ctx, payload, len(payload))
            if err != 0:
                raise OSError(f"munge: {lib.munge_strerror(err).decode(errors='replace')}")
            try:
                return ctypes.string_at(cred)
            finally:
                self._libc.free(cred)
        finally:
            lib.munge_ctx_destroy(ctx)

    def _decode(self, cred: bytes) -> tuple[bytes, int] | None:
        lib = self._lib
        buf, length = ctypes.c_void_p(), ctypes.c_int()
        uid, gid = ctypes.c_uint(), ctypes.c_uint()
        err = lib.munge_decode(cred, None, ctypes.byref(buf), ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        try:
            if err != 0:
                return None
            return ctypes.string_at(buf, length.value) if buf.value else b"", uid.value
        finally:
            if buf.value:
                self._libc.free(buf)


#: libmunge's MUNGE_OPT_UID_RESTRICTION (munge.h's munge_opt_t)
_MUNGE_OPT_UID_RESTRICTION = 9


def munge_key() -> MungeKey | None:
    """A :class:`MungeKey` where libmunge loads and munged answers (a proof made and checked); else None."""
    name = ctypes.util.find_library("munge") or "libmunge.so.2"
    try:
        lib = ctypes.CDLL(name)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    lib.munge_ctx_create.restype = ctypes.c_void_p
    lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
    lib.munge_ctx_set.restype = ctypes.c_int
    lib.munge_strerror.argtypes = [ctypes.c_int]
    lib.munge_strerror.restype = ctypes.c_char_p
    lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.munge_decode.argtypes = [
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
    ]
    libc.free.argtypes = [ctypes.c_void_p]
    key = MungeKey(lib, libc)
    try:
        message = new_nonce()
        if not key.verify(b"probe", message, key.prove(b"probe", message)):
            return None
    except OSError:
        return None
    return key


def as_key(secret: bytes | str | JobKey | None, fn: str) -> JobKey | None:
    """The key a ``secret=`` argument gives (None: none).

    Raises:
        TypeError: ``secret`` is not bytes, str, a JobKey or None.
        ValueError: it is shorter than 16 bytes.
    """
    if secret is None or isinstance(secret, JobKey):
        return secret
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"{fn}: secret must be bytes, str or None, got {type(secret).__name__}")
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"{fn}: secret must be at least {_MIN_SECRET_BYTES} bytes long, got {len(secret)}")
    return SecretKey(secret)


def secret_from_env(fn: str, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret ``MPIDIST_SECRET`` (or the file ``MPIDIST_SECRET_FILE`` names) gives; None where neither is set.

    The file must belong to this user and be readable by no one else (as ssh's keys).

    Raises:
        ValueError: the secret is shorter than 16 bytes, or the file cannot be read or others can read it.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(SECRET_ENV, "")
    path = environ.get(SECRET_FILE_ENV, "").strip()
    if not text and path:
        text = _read_secret_file(path, fn)
    if not text:
        return None
    secret = text.strip().encode()
    if len(secret) < _MIN_SECRET_BYTES:
        where = SECRET_ENV if environ.get(SECRET_ENV) else f"the file {SECRET_FILE_ENV} names"
        raise ValueError(
            f"{fn}: the secret in {where} must be at least {_MIN_SECRET_BYTES} bytes long, got {len(secret)}; "
            'make one with: python -c "import secrets; print(secrets.token_hex(32))"'
        )
    return secret


def _read_secret_file(path: str, fn: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"{fn}: cannot read {SECRET_FILE_ENV}={path!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"{fn}: {SECRET_FILE_ENV}={path!r} must belong to this user and be readable by no one else "
                f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it"
            )
        return os.read(fd, 4096).decode(errors="strict")
    except UnicodeDecodeError:
        raise ValueError(f"{fn}: {SECRET_FILE_ENV}={path!r} must hold text") from None
    finally:
        os.close(fd)
