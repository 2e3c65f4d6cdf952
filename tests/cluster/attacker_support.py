"""Another UNIX user on this machine, for tests/cluster/test_attacks.py: the attacker of mpidist's jobs.

The session fixture :func:`attacker` (root only) creates a system user with a unique
name, a folder ``/var/tmp/mpidist-attacker-<random>`` that holds its home, a copy of
this checkout's sources and a virtual environment made with Debian's ``/usr/bin/python3``
(root's own Python lives under ``/root``, mode 0700, which the user cannot enter), into
which it installs mpidist with the MPICH wheel from that copy. Commands then run as that
user (``setpriv``: its uid, gid and groups, no capabilities) in a clean environment: only
``PATH``, ``HOME`` and what the caller passes. At the end every process of the user is
killed, the user removed (``userdel -r``), its files in ``/dev/shm`` and ``/tmp`` and the
folder deleted: the machine is left as it was found.

Where it cannot run (not root, no ``useradd``/``setpriv``, no network for pip) the tests
skip with the reason; under ``CI=true`` as root a set-up that fails fails the tests instead,
so that CI never passes by skipping them.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Debian's Python: every user can run it (pyenv's, first on root's PATH, is under /root)
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: what of the checkout the attacker's install needs
_SOURCES = ("mpidist", "_mpidist_autoload.py", "pyproject.toml", "setup.py", "setup.cfg", "README.md", "LICENSE")
#: bound on the whole set-up (useradd, venv, pip)
SETUP_S = 240


def in_ci() -> bool:
    """Whether this is a CI run (``CI=true``), where a set-up that cannot be made is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def cannot(reason: str) -> None:
    """Skip with ``reason``; under CI as root, fail with it (the attacks must run there)."""
    if in_ci() and os.geteuid() == 0:
        pytest.fail(f"attacker set-up: {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Attacker:
    """An unprivileged user of this machine, with mpidist installed for it.

    Attributes:
        user: its name; ``uid``/``gid``: its ids.
        root: its folder (home, sources, venv, ``work/``), owned by it.
        python: its interpreter (the venv's, on Debian's Python).
    """

    user: str
    uid: int
    gid: int
    root: Path
    python: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def bin(self) -> Path:
        return self.python.parent

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The clean environment its commands get: PATH (its venv first), HOME, and ``extra``."""
        env = {"PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home)}
        env.update(extra or {})
        return env

    def command(self, args: Sequence[str | os.PathLike]) -> list[str]:
        """``args`` prefixed so that they run as this user (its uid, gid and groups; no capabilities)."""
        return [
            "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--inh-caps=-all", "--",
            *[str(a) for a in args],
        ]  # fmt: skip

    def popen(
        self,
        args: Sequence[str | os.PathLike],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
        **kwargs,
    ) -> subprocess.Popen:
        """Start ``args`` as this user in a session of its own (``prefix``, e.g. a namespace entry, runs first, as root).

        Output goes where ``kwargs`` say (stdout=, stderr=); standard input is closed.
        """
        return subprocess.Popen(
            [*prefix, *self.command(args)], env=self.env(env), cwd=str(cwd or self.root / "work"),
            stdin=subprocess.DEVNULL, start_new_session=True, **kwargs,
        )  # fmt: skip

    def run(
        self,
        args: Sequence[str | os.PathLike],
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
    ) -> subprocess.CompletedProcess:
        """Run ``args`` as this user and wait (at most ``timeout`` s: then killed, exit code 124); never raises."""
        p = self.popen(args, env, cwd, prefix, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
            return subprocess.CompletedProcess(p.args, p.returncode, out, err)
        except subprocess.TimeoutExpired:
            kill_group(p)
            out, err = p.communicate()
            return subprocess.CompletedProcess(p.args, 124, out, (err or "") + f"\n[killed after {timeout} s]")

    def workdir(self, name: str) -> Path:
        """A fresh folder ``work/<name>-<random>`` that this user owns (mode 0755: root and it exchange files there)."""
        path = self.root / "work" / f"{name}-{secrets.token_hex(3)}"
        path.mkdir(mode=0o755)
        os.chown(path, self.uid, self.gid)
        return path

    def kill_all(self) -> None:
        """SIGKILL every process of this user (bounded wait until none is left)."""
        for _ in range(50):
            if subprocess.run(["pkill", "-KILL", "-u", str(self.uid)], capture_output=True, timeout=10).returncode:
                return  # 1: no process matched
            time.sleep(0.1)


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the session ``p`` leads (started with ``start_new_session``) and reap it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _sh(cmd: Sequence[str | os.PathLike], seconds: float, env: Mapping[str, str] | None = None) -> str:
    """Run a set-up command as root; raise RuntimeError with its output when it fails."""
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=seconds, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: no end within {seconds} s") from None
    if r.returncode:
        raise RuntimeError(
            f"{' '.join(map(str, cmd))} failed (exit {r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return r.stdout


def _ensure_system_venv() -> None:
    """Debian's python3-venv (and python3-dev, for mpidist's C extensions) where they are missing."""
    probe = subprocess.run([str(SYSTEM_PYTHON), "-c", "import ensurepip, venv"], capture_output=True, timeout=30)
    if probe.returncode == 0:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _sh(["apt-get", "update"], 180, env)
    _sh(["apt-get", "install", "-y", "python3-venv", "python3-dev"], 180, env)


def _copy_sources(dest: Path) -> None:
    """Copy what mpidist's install needs from this checkout to ``dest`` (no build outputs)."""
    dest.mkdir()
    for name in _SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def _remove_user_files(uid: int) -> None:
    """Delete what the user left in /dev/shm and at the top of /tmp (MPI's segments, sockets)."""
    for folder in (Path("/dev/shm"), Path("/tmp")):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.lstat().st_uid != uid:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink()
            except OSError:
                pass


def _create(stack: list) -> Attacker:
    """Make the user, its folder and venv (each step recorded on ``stack`` for the teardown)."""
    user = f"mpdatk{secrets.token_hex(4)}"
    root = Path(f"/var/tmp/mpidist-attacker-{secrets.token_hex(6)}")
    root.mkdir(mode=0o755)
    stack.append(("folder", root))
    home = root / "home"
    _sh(["useradd", "--system", "--user-group", "--create-home", "--home-dir", home,
         "--shell", "/usr/sbin/nologin", user], 60)  # fmt: skip
    stack.append(("user", user))
    entry = pwd.getpwnam(user)
    attacker = Attacker(user, entry.pw_uid, entry.pw_gid, root, root / "venv" / "bin" / "python")
    stack.append(("attacker", attacker))
    _copy_sources(root / "src")
    (root / "work").mkdir()
    _sh(["chown", "-R", f"{attacker.uid}:{attacker.gid}", root], 60)
    step = attacker.run([SYSTEM_PYTHON, "-m", "venv", root / "venv"], timeout=60)
    if step.returncode:
        raise RuntimeError(f"python3 -m venv as {user} failed (exit {step.returncode}): {step.stdout}{step.stderr}")
    pip = [attacker.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # the build needs numpy's headers and setuptools: installed first, the copy then builds against them
    for args in (["mpi4py", "mpich", "numpy", "ml_dtypes", "setuptools>=77", "wheel"],
                 ["--no-build-isolation", "--no-deps", root / "src"]):  # fmt: skip
        step = attacker.run([*pip, *args], timeout=SETUP_S, env={"PIP_NO_CACHE_DIR": "1"})
        if step.returncode:
            raise RuntimeError(f"pip install {args} as {user} failed (exit {step.returncode}): {step.stderr[-3000:]}")
    check = attacker.run([attacker.python, "-c", "import mpidist, mpi4py; print(mpidist.__file__)"], timeout=60)
    if check.returncode or str(root) not in check.stdout:
        raise RuntimeError(f"mpidist does not import in {user}'s venv: {check.stdout}{check.stderr}")
    return attacker


def _teardown(stack: list) -> None:
    """Undo :func:`_create`'s steps, last first; never raises."""
    uid = None
    for kind, what in reversed(stack):
        try:
            if kind == "attacker":
                uid = what.uid
                what.kill_all()
            elif kind == "user":
                subprocess.run(["userdel", "-r", "-f", what], capture_output=True, timeout=60)
                if uid is not None:
                    _remove_user_files(uid)
            elif kind == "folder":
                shutil.rmtree(what, ignore_errors=True)
        except (OSError, subprocess.SubprocessError):
            pass


@pytest.fixture(scope="session")
def attacker() -> Iterator[Attacker]:
    """Another user with mpidist installed (see the module's docstring); removed at the session's end."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it creates another user to attack the jobs (useradd)")
    missing = [t for t in ("useradd", "userdel", "setpriv", "pkill") if shutil.which(t) is None]
    if missing or not SYSTEM_PYTHON.exists():
        cannot(f"cannot create the attacking user: missing {', '.join(missing) or SYSTEM_PYTHON}")
    stack: list = []
    try:
        _ensure_system_venv()
        made = _create(stack)
    except (OSError, RuntimeError, subprocess.SubprocessError, KeyError) as exc:
        _teardown(stack)
        cannot(f"cannot set up the attacking user: {exc}")
    try:
        yield made
    finally:
        _teardown(stack)
