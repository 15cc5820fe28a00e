"""What a failed write means, said so a person can act on it: a full disk, a quota, a file-size limit
(``ulimit -f``), a read-only or unwritable directory, a file where a directory should be.

A file-size limit and a full disk both stop a write, but only one is fixed by freeing space: under
``ulimit -f`` (RLIMIT_FSIZE) the kernel sends SIGXFSZ (which Python ignores) and the write fails with
EFBIG, while the disk may have plenty of room. torch's writer reports either as a RuntimeError without an
errno, so `write_failure_hint` looks at the limit and the free space itself.
"""

from __future__ import annotations

import errno
import os
import shutil


def file_size_limit() -> int | None:
    """This process's RLIMIT_FSIZE soft limit in bytes, or None when there is none (or no `resource`)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def free_gib(path: str | os.PathLike) -> float | None:
    """Free space of the file system holding ``path`` (or its nearest existing parent), in GiB."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free / 2**30
    except OSError:
        return None

# The errors that mean the bytes did not fit: a full disk, a quota, a file-size limit.
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_failure_hint(err: BaseException, path: str | os.PathLike) -> str:
    """What to do about ``err``, a write under ``path`` that failed because the bytes did not fit, as a
    sentence: the file-size limit (EFBIG, or a limit in force for an error without errno), the quota
    (EDQUOT), else a full disk (ENOSPC) with the free space measured.

        >>> import errno
        >>> write_failure_hint(OSError(errno.EDQUOT, "Disk quota exceeded"), "/tmp").startswith("over the disk quota")
        True
    """
    code = getattr(err, "errno", None)
    limit = file_size_limit()
    free = free_gib(path)
    room = "" if free is None else f"; {free:.2f} GiB free there"
    if code == errno.EFBIG or (code is None and limit is not None):
        shown = "" if limit is None else f" of {limit} bytes"
        return (f"a file reached this process's file-size limit{shown} (ulimit -f, RLIMIT_FSIZE){room}: raise the limit "
                "(ulimit -f unlimited) where the run is started, freeing disk space will not help")
    if code == errno.EDQUOT:
        return f"over the disk quota{room}: free some of your space or raise the quota"
    return f"no space left on the device{room}: free some space"


_DIRECTORY_ERRORS = {
    errno.ENOTDIR: "a file is in the way (not a directory)",
    errno.EEXIST: "a file is in the way (not a directory)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def describe_os_error(err: OSError) -> str:
    """One line for an OSError that reached the top of a script: what failed, on which file, and what to do.

        >>> import errno
        >>> describe_os_error(NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x/y")).split(": ")[:2]
        ['cannot write /x/y', 'a file is in the way (not a directory)']
    """
    name = err.filename if err.filename is not None else "a file"
    if err.errno in NO_ROOM_ERRNOS:
        where = err.filename if err.filename is not None else "."
        return f"cannot write {name}: {err.strerror}: {write_failure_hint(err, where)}"
    if err.errno in _DIRECTORY_ERRORS:
        return (f"cannot write {name}: {_DIRECTORY_ERRORS[err.errno]}: logger.log_dir and checkpointing.checkpoint_dir "
                "must name directories this run can write (or create)")
    return f"{name}: {err.strerror or err}"
