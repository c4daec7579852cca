"""The ``namespaces`` sandbox level: what bubblewrap does, for a machine without it. ``lit_spec.data.execution`` runs
this file as a script (standard library only, ``python -I -S namespaces.py SPEC PROGRAM...``) as root, or as an
ordinary user inside an unprivileged user namespace where the kernel allows one. It unshares the mount, network, IPC,
UTS and pid namespaces. The program's pid 1 builds a new root on a tmpfs: the system directories bound read-only, a
/proc of its own pid namespace, the null/zero/random devices, and size-limited tmpfs at /tmp, /var/tmp, /dev/shm and
the working directory /sandbox. It pivots into that root, detaches the old one, drops to uid ``nobody`` and execs
the program. This first process stays outside, waits, and exits with the program's status. If it is killed, the
program is too (``PR_SET_PDEATHSIG``), and with it the whole pid namespace. A set-up failure exits 125 before the
program starts."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 2, 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
NOBODY = 65534
DEVICES = ("null", "zero", "full", "random", "urandom")
# statvfs flags a read-only remount keeps (an unprivileged remount may not clear the ones the mount has)
KEPT = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME,
        os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


def _call(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target: str, fstype, flags: int, data: str | None = None) -> None:
    _call(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:   # field 5, octal-escaped (a space is \040)
        return [line.split()[4].encode().decode("unicode_escape") for line in f]


def _read_only(path: str) -> None:
    flags = os.statvfs(path).f_flag
    kept = sum(ms for st, ms in KEPT.items() if flags & st)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _build_root(root: str, spec: dict) -> None:
    """The new root at ``root`` (a tmpfs), from the old tree still visible around it."""
    size = f"size={spec['tmpfs_bytes']}"
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=0755")
    for path in spec["binds"]:
        inside = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(path), inside)
        elif os.path.isdir(path):
            os.makedirs(inside, exist_ok=True)
            _mount(path, inside, None, MS_BIND | MS_REC)
    for point in _mount_points():             # every bound mount read-only, submounts included (/etc/hosts, ...)
        if point.startswith(root + "/"):
            _read_only(point)
    os.makedirs(root + "/dev")
    for device in DEVICES:
        _write(f"{root}/dev/{device}", "")
        _mount(f"/dev/{device}", f"{root}/dev/{device}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for path in ("/tmp", "/var/tmp", "/dev/shm", "/sandbox"):
        os.makedirs(root + path)
        mode = "0755" if path == "/sandbox" else "1777"
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode={mode},uid={NOBODY},gid={NOBODY}")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _enter(root: str) -> None:
    """``root`` becomes / (pivot_root), the old root is detached, and / is read-only."""
    os.makedirs(root + "/.old")
    os.chdir(root)
    _call(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b".old"), "pivot_root")
    os.chroot(".")
    _call(libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/sandbox")


def _program(spec: dict, command: list[str]) -> None:
    """pid 1 of the new pid namespace: build, enter, drop, exec."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)      # nothing mounted here propagates back
    _build_root(spec["root"], spec)
    _enter(spec["root"])
    if os.geteuid() == 0:                              # root: drop to nobody (in a user namespace it already is)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    _call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")    # after setuid, which clears it
    os.execve(command[0], command, {**os.environ, "HOME": "/sandbox"})


def main() -> None:
    spec, command = json.loads(sys.argv[1]), sys.argv[2:]
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")   # dies with its caller
        user = 0 if uid == 0 else CLONE_NEWUSER
        _call(libc.unshare(user | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID), "unshare")
        if user:                                       # the caller's uid and gid are nobody's inside
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{NOBODY} {uid} 1")
            _write("/proc/self/gid_map", f"{NOBODY} {gid} 1")
        pid = os.fork()
    except OSError as e:
        print(f"lit_spec sandbox: {e}", file=sys.stderr, flush=True)
        os._exit(125)
    if pid == 0:
        try:
            _program(spec, command)
        except OSError as e:
            print(f"lit_spec sandbox: {e}", file=sys.stderr, flush=True)
        os._exit(125)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
