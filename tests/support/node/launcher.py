"""Start one container process: join the pod's network namespace, enter a mount and UTS
namespace of its own, bind-mount the container's volumes at their mount paths, set the
hostname to the pod's name, then exec the container's command with its environment.

Run by the agent as ``python -S -P launcher.py SPEC.json`` (standard library only, so it
starts fast); the exec keeps the process id, which is the container's pid. A failure before
the exec prints why and exits 128, as a runtime's start error does.

SPEC: {"netns": path, "hostname": str, "mounts": [{"source", "target", "readOnly"}],
       "argv": [...], "env": {...}, "cwd": str, "deathSignal": int,
       "mountPointLock": path, "mountPointLog": path, "hostPaths": [path, ...]}

``hostPaths`` are the host directories the image's programs run from (the virtual environment,
the checkout of an editable install, the base interpreter): a volume mounted over one of them
(an emptyDir on /tmp, with the checkout under /tmp) would hide the program, so each one a
volume covers is bound back at its own path inside that volume.
"""

import ctypes
import fcntl
import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
O_PATH = 0o10000000

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def make_mount_point(target: str, directory: bool) -> list[str]:
    """Create a missing mount point (and missing parents); the paths created, outermost first."""
    missing = []
    path = target
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for i, path in enumerate(reversed(missing)):
        if directory or i < len(missing) - 1:
            os.mkdir(path)
        else:
            open(path, "a").close()
    return list(reversed(missing))


def covered(path: str, mounted: list[str]) -> bool:
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in mounted)


def bind(source_fd: int, target: str, read_only: bool) -> None:
    src = f"/proc/self/fd/{source_fd}".encode()
    check(
        libc.mount(src, target.encode(), None, MS_BIND | MS_REC, None), f"bind-mount onto {target}"
    )
    if read_only:
        check(
            libc.mount(b"none", target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None),
            f"read-only remount of {target}",
        )


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("deathSignal"):
        libc.prctl(PR_SET_PDEATHSIG, int(spec["deathSignal"]), 0, 0, 0)
    fd = os.open(spec["netns"], os.O_RDONLY)
    check(libc.setns(fd, CLONE_NEWNET), "join the pod's network namespace")
    os.close(fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare mount+UTS namespaces")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    hostname = spec["hostname"].encode()[:63]
    check(libc.sethostname(hostname, len(hostname)), "sethostname")
    # Open every source before mounting anything: a mount (say an emptyDir on /tmp) may cover
    # where a later source lives.
    mounts = sorted(spec["mounts"], key=lambda m: m["target"].rstrip("/").count("/"))
    fds = [os.open(m["source"], O_PATH) for m in mounts]
    host_paths = [p for p in spec.get("hostPaths", ()) if os.path.isdir(p)]
    host_fds = [os.open(p, O_PATH) for p in host_paths]
    is_dir = [os.path.isdir(m["source"]) for m in mounts]
    # Mount points the host lacks are made on the host's file system (recorded, so the cluster
    # removes them when no cluster runs); the shared lock keeps that removal from racing us.
    lock = open(spec["mountPointLock"], "a") if spec.get("mountPointLock") else None
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_SH)
    mounted: list[str] = []
    for m, source_fd, directory in zip(mounts, fds, is_dir):
        created = make_mount_point(m["target"], directory)
        if created and not covered(m["target"], mounted) and spec.get("mountPointLog"):
            with open(spec["mountPointLog"], "a") as log:
                log.write("".join(f"{path}\n" for path in created))
        bind(source_fd, m["target"], bool(m.get("readOnly")))
        mounted.append(m["target"])
    if lock is not None:
        lock.close()
    for path, path_fd in zip(host_paths, host_fds):
        if covered(path, mounted):  # made inside the covering volume: no host mount point to log
            make_mount_point(path, True)
            bind(path_fd, path, False)
    for source_fd in fds + host_fds:
        os.close(source_fd)
    os.chdir(spec.get("cwd") or "/")
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as exc:  # the container's log says why it did not start
        print(f"container start failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(128)
