"""Grading untrusted notebooks isolated: the learner's kernel in its own Linux namespaces, with limits.

The grader starts each kernel through this file, run as a script (standard library only, so it starts in a few
milliseconds and imports nothing a submission could have touched):

    python isolation.py --launch CGROUP N -- unshare --net --mount --pid --ipc --fork --mount-proc --kill-child \\
        python isolation.py --init CONFIG -- python -m ipykernel_launcher -f connection.json

1. ``--launch`` joins a pids cgroup of its own where it can, then asks the kernel (``prctl(PR_SET_PDEATHSIG)``,
   man 2 prctl, kept across ``execve``) for SIGKILL when the papermill process that started it dies, and
   ``unshare --kill-child`` passes that death on to the namespace's first process: killing the grader kills its
   whole family.
2. ``unshare`` (util-linux; man 1 unshare, man 7 namespaces) gives the kernel new network, mount, PID and IPC
   namespaces: as root directly, as another user inside a new user namespace (``--user --map-root-user``) when the
   kernel allows unprivileged ones. ``available()`` tries it once and says why not.
3. ``--init`` is process 1 of the new PID namespace. It brings up ``lo`` only (the ranks talk over loopback; no other
   interface exists, so nothing outside the machine or on it can be reached over the network), makes every mount
   read-only (the course, the Python environment, the system), mounts fresh private ``tmpfs`` on ``/tmp`` and
   ``/dev/shm``, binds back read-only what the kernel needs that lay under them (``Sandbox.keep``: the course, its
   interpreter and its packages, by their real location, and the symbolic links on the way: a course in the temp
   folder), binds the submission's own temporary folder back writable, and mounts an empty read-only ``tmpfs``
   over each hidden folder (the other submissions, the output folder, ``solutions/``, ``tests/``). Then it starts
   the kernel with ``RLIMIT_AS`` (memory, per process), ``RLIMIT_NPROC`` and no core dumps, and watches: more than
   ``processes`` processes in the namespace (a fork bomb: ``RLIMIT_NPROC`` does not hold root back), or a fork
   refused by the pids cgroup that ``--launch`` made where the machine lets it (``join_pids_cgroup``), and it ends
   them all: when process 1 exits, the kernel kills everything left in the namespace and refuses new processes.

What it does not protect against: a kernel exploit (namespaces share one kernel), the machine's CPU time and disk
bandwidth taken from other jobs (no CPU quota; the time limit bounds it), memory summed over the kernel's ranks
(the limit is per process), and anything inside the kernel itself: the hidden checks run there, so a notebook can
read their source and their settings (not the answer keys: ``solutions/`` is hidden) and can patch them in its own
process. The grader signs the results (``course_lib.grading.grader``) so that a results file written by the
notebook is refused, but code that hooks the kernel's execution before the grading cell runs is not stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import site
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

SCRIPT = Path(__file__).resolve()
COURSE = SCRIPT.parents[2]
MARK = "course-sandbox:"
NO_START = "the kernel could not start:"
"""Process 1's line when the kernel's command cannot be executed (the grader reports "never started")."""
PRIVATE = ("/tmp", "/dev/shm")
"""Process 1's lines on stderr start with this: the grader reads the reason a kernel was killed from them."""
NAMESPACES = ["--net", "--mount", "--pid", "--ipc", "--fork", "--mount-proc"]
SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|^AWS_|^GH_|^GITHUB_|^SSH_|^CI_JOB", re.I)
WATCH_S = 0.005


def tasks_limit(processes: int) -> int:
    """The pids cgroup counts threads: room for each process's thread pool (torch starts one per core)."""
    return processes * (8 + (os.cpu_count() or 1))

_PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, \
    MS_RELATIME = 1, 2, 4, 8, 32, 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_ST_TO_MS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME,
             os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}


@dataclass
class Sandbox:
    """One submission's limits and view of the files: ``work`` writable (the notebook's temporary folder, where
    the kernel's sockets live too), ``hidden`` folders empty, everything else read-only."""

    work: str
    hidden: list[str] = field(default_factory=list)
    memory_bytes: int = 8 << 30
    processes: int = 256
    keep: list[str] = field(default_factory=list)
    """Paths the kernel needs (``kept_paths()``): bound back read-only where a private ``tmpfs`` covers them."""

    @property
    def cgroup(self) -> str:
        return f"course-grade-{os.path.basename(self.work)}"

    def wrap(self, kernel_cmd: list[str]) -> list[str]:
        """The command that starts ``kernel_cmd`` inside the sandbox (``available()`` must have said yes)."""
        flags = available().flags
        assert flags is not None, available().reason
        py = [sys.executable, "-I", "-S", str(SCRIPT)]
        box = asdict(self)
        box["keep"] = [*self.keep, shutil.which(kernel_cmd[0]) or kernel_cmd[0]]  # the kernel's own interpreter
        return [*py, "--launch", self.cgroup, str(self.processes), "--", "unshare", *flags, "--kill-child", *py,
                "--init", json.dumps(box), "--", *kernel_cmd]


def _link_hops(path: str) -> list[str]:
    """The folders of every link on the way from ``path`` to its file (a venv's python links to another
    venv's, which links to the system's: each hop must be visible for the first to run)."""
    hops = [os.path.dirname(path)]
    for _ in range(40):
        if not os.path.islink(path):
            break
        path = os.path.join(os.path.dirname(path), os.readlink(path))
        hops.append(os.path.dirname(os.path.abspath(path)))
    return hops


def kept_paths() -> list[str]:
    """What every kernel needs to see, as this process reaches it: the course, the interpreter (its prefixes and
    every link to its real location) and its packages (site-packages, the folders a ``.pth`` file added to
    ``sys.path``, ``PYTHONPATH``)."""
    paths = [str(COURSE), sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *_link_hops(sys.executable), os.path.dirname(os.path.realpath(sys.executable)),
             *site.getsitepackages(), *(p for p in sys.path if os.path.isdir(p)),
             *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return list(dict.fromkeys(os.path.abspath(p) for p in paths if p and os.path.exists(p)))


def parent_death() -> list[str]:
    """A prefix that arms SIGKILL on the parent's death, then execs the command that follows it."""
    return [sys.executable, "-I", "-S", str(SCRIPT), "--parent-death", "--"]


def _pids_cgroup_parent() -> Path | None:
    """This process's cgroup directory of the ``pids`` controller (v1, or v2 with ``pids`` delegated), or None."""
    with contextlib.suppress(OSError):
        mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for m in mounts:
                fstype, options = m[m.index("-") + 1], m[-1].split(",")
                v1 = controllers and "pids" in controllers.split(",") and fstype == "cgroup" and "pids" in options
                if v1 or (not controllers and fstype == "cgroup2"):
                    where = Path(m[4]) / path.lstrip("/")
                    if v1 or "pids" in (where / "cgroup.subtree_control").read_text().split():
                        return where
    return None


def join_pids_cgroup(name: str, processes: int) -> bool:
    """Create the cgroup ``name`` with ``pids.max = processes`` (Documentation/admin-guide/cgroup-v2.rst, "PID")
    and move this process into it: the kernel then refuses the fork past the limit, root or not."""
    parent = _pids_cgroup_parent()
    if parent is None:
        return False
    with contextlib.suppress(OSError):
        group = parent / name
        group.mkdir(exist_ok=True)
        (group / "pids.max").write_text(str(tasks_limit(processes)))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return True
    return False


def remove_cgroup(name: str) -> None:
    """Remove the (now empty) cgroup ``join_pids_cgroup`` made, once the sandbox is gone."""
    parent = _pids_cgroup_parent()
    if parent is not None and (parent / name).is_dir():
        for _ in range(50):
            try:
                (parent / name).rmdir()
                return
            except OSError:
                time.sleep(0.1)


@dataclass(frozen=True)
class Availability:
    flags: list[str] | None
    reason: str


@lru_cache(maxsize=1)
def available() -> Availability:
    """Whether this machine lets the grader make namespaces, tried for real: as root directly, otherwise in a new
    user namespace. ``flags`` for ``unshare``, or None with the kernel's or the tool's own words why not."""
    if not sys.platform.startswith("linux"):
        return Availability(None, f"namespaces are Linux only (this is {sys.platform})")
    if shutil.which("unshare") is None:
        return Availability(None, "`unshare` (util-linux) is not installed")
    tries = [NAMESPACES] if os.geteuid() == 0 else []
    tries.append(["--user", "--map-root-user", *NAMESPACES])
    why = ""
    with tempfile.TemporaryDirectory(prefix="course_sandbox_probe_") as work:
        for flags in tries:
            probe = [*flags, sys.executable, "-I", "-S", str(SCRIPT), "--probe", work]
            try:
                out = subprocess.run(["unshare", *probe], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as err:
                why = str(err)
                continue
            if out.returncode == 0 and out.stdout.strip() == "ok":
                return Availability(flags, "")
            why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    return Availability(None, f"this machine refuses new namespaces ({why})")


# ----------------------------------------------------------------------------------------------------------------
# Inside the namespaces (process 1)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    if _libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def loopback_up() -> None:
    """``ip link set lo up`` with the ioctl it uses (SIOCGIFFLAGS/SIOCSIFFLAGS, man 7 netdevice)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")
            points.append(target)
    return points


def _read_only(target: str) -> None:
    """Remount ``target`` read-only, keeping its other flags (a user namespace may not drop them)."""
    try:
        st = os.statvfs(target)
    except OSError:
        return  # a mount point hidden under another mount
    keep = sum(ms for st_flag, ms in _ST_TO_MS.items() if st.f_flag & st_flag)
    with contextlib.suppress(OSError):  # e.g. a mount shadowed by another: what is visible is handled
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _to_keep(keep: list[str], private: list[str]) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
    """Before the private ``tmpfs`` goes on: an ``O_PATH`` descriptor of the real location of each kept path that
    lies under one (outermost only: a bind carries what is inside), and each symbolic link under one on the way."""
    real, links = [], []
    for path in map(os.path.abspath, keep):
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            prefix = os.path.join(*parts[:i])
            if _under(prefix, private) and os.path.islink(prefix):
                links.append((prefix, os.readlink(prefix)))
                real.append(os.path.realpath(prefix))
        real.append(os.path.realpath(path))
    real = sorted({p for p in real if _under(p, private) and p not in private and os.path.exists(p)}, key=len)
    outer = [p for i, p in enumerate(real) if not _under(p, real[:i])]
    return [(p, os.open(p, os.O_PATH)) for p in outer], links


def _restore(kept: list[tuple[str, int]], links: list[tuple[str, str]]) -> None:
    """Bind each kept path back (read-only) into the fresh ``tmpfs`` over it, and re-create the links to it."""
    for path, fd in kept:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()  # a mount point for a file
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _read_only(path)
        os.close(fd)
    for link, target in sorted(links, key=lambda lt: len(lt[0])):
        if not os.path.lexists(link):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(target, link)


def enter(box: Sandbox) -> None:
    """Make this mount namespace the submission's view of the files and bring up loopback."""
    loopback_up()
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    work_fd = os.open(box.work, os.O_PATH | os.O_DIRECTORY)
    for point in _mount_points():
        if point != "/proc" and not point.startswith("/proc/"):
            _read_only(point)
    private = [p for p in PRIVATE if os.path.isdir(p)]
    kept, links = _to_keep(box.keep, private)
    for point in private:
        _mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    _restore(kept, links)
    os.makedirs(box.work, exist_ok=True)
    _mount(f"/proc/self/fd/{work_fd}", box.work, None, MS_BIND)
    _mount(None, box.work, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
    os.close(work_fd)
    for hidden in box.hidden:
        if os.path.isdir(hidden) and not box.work.startswith(hidden.rstrip("/") + "/"):
            _mount("tmpfs", hidden, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=555")


def _kernel_env(box: Sandbox) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not SECRET_ENV.search(k) and k != "JPY_PARENT_PID"}  # pid 1 here
    env.update(HOME=box.work, TMPDIR="/tmp", IPYTHONDIR=f"{box.work}/.ipython", MPLCONFIGDIR=f"{box.work}/.mpl")
    return env


def _processes() -> int:
    return sum(name.isdigit() for name in os.listdir("/proc"))


def _forks_refused(events: Path | None) -> bool:
    """Whether the pids cgroup refused a fork (its ``pids.events`` counts them as ``max N``)."""
    with contextlib.suppress(OSError, ValueError):
        return events is not None and int(events.read_text().split()[1]) > 0
    return False


def init(box: Sandbox, cmd: list[str]) -> int:
    """Process 1: set the namespace up, start ``cmd`` with the limits, watch the process count, reap orphans."""
    try:
        enter(box)
    except OSError as err:
        print(f"{MARK} could not set the sandbox up: {err}", file=sys.stderr, flush=True)
        return 70
    group = _pids_cgroup_parent()
    refused = group / "pids.events" if group is not None and group.name == box.cgroup else None
    kernel = os.fork()
    if kernel == 0:
        resource.setrlimit(resource.RLIMIT_AS, (box.memory_bytes, box.memory_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (box.processes, box.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.chdir(box.work)
        try:
            os.execvpe(cmd[0], cmd, _kernel_env(box))
        except OSError as err:
            print(f"{MARK} {NO_START} {cmd[0]}: {err.strerror}", file=sys.stderr, flush=True)
            os._exit(127)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(kernel, signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell time limit's interrupt goes to the process group
    while True:
        while True:  # reap every exited child; the kernel's own status ends the namespace
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
            if pid == kernel:
                return os.waitstatus_to_exitcode(status) & 0xFF
        if _processes() >= box.processes or _forks_refused(refused):
            print(f"{MARK} killed: {box.processes} processes or more (a fork bomb?)", file=sys.stderr, flush=True)
            os._exit(137)  # process 1 gone: the kernel kills the namespace's processes and refuses new ones
        time.sleep(WATCH_S)


def _arm_parent_death() -> None:
    _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "--probe":  # inside the namespaces: the whole set-up, then a write in the work folder
        enter(Sandbox(sys.argv[2]))
        Path(sys.argv[2], "probe").write_text("ok")
        print("ok")
    elif mode == "--parent-death":
        _arm_parent_death()
        try:
            os.execvp(sys.argv[3], sys.argv[3:])
        except OSError as err:
            print(f"{MARK} {NO_START} {sys.argv[3]}: {err.strerror}", file=sys.stderr, flush=True)
            sys.exit(127)
    elif mode == "--launch":  # outside the namespaces: the pids cgroup, then the parent-death signal
        join_pids_cgroup(sys.argv[2], int(sys.argv[3]))
        _arm_parent_death()
        os.execvp(sys.argv[5], sys.argv[5:])
    elif mode == "--init":
        sys.exit(init(Sandbox(**json.loads(sys.argv[2])), sys.argv[4:]))
