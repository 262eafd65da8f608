"""Files a job holds open: saved with their place (and, when written, their bytes), re-opened exactly.

Scripts keep a log or a metrics file open across the training loop: ``with open("log.txt", "w")
as log:`` around it, or ``metrics = open(path, "a")`` before it. A restore that simply re-ran the
``open`` would truncate the file (mode ``w``) or keep the lines written after the checkpoint
(mode ``a``, after a crash): the file would no longer be the uninterrupted run's. So a checkpoint
records, for each open regular file, its path, mode and position, and for a file open for writing
its whole contents as they are on disk after a flush; the restore puts those bytes back and seeks
to the position. Reading files get their position back; their contents are the user's input and
are not copied. A character device (``/dev/null``) is opened again by name.

A read-only ``numpy.memmap`` of a whole file (a token dataset) is saved as the file's name, not its
bytes, and mapped again on restore (refused then if the file's size changed); so is an open
``.npz`` archive (``d = np.load("train.npz")``), loaded again with ``np.load``.

A file whose contents are larger than `MAX_CONTENT_BYTES` is refused with advice, as are streams
that are not regular files (pipes, sockets, ttys): nothing can put them back where they were.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import stat
import sys
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from typing import IO, Any, Optional

from . import context, text_newline

#: above this, a written file's bytes are not copied into every checkpoint: the save is refused
MAX_CONTENT_BYTES = 256 << 20


#: files `reopen` made, with what they were made from (`take_over` puts the bytes back again)
_reopened: "weakref.WeakKeyDictionary[Any, FileState]" = weakref.WeakKeyDictionary()


class FileNotCarried(Exception):
    """An open file that a checkpoint cannot carry; the message says why and what to do."""


@dataclass(frozen=True)
class FileState:
    """What re-opens one file where it was: ``path`` is relative to the job's folder when inside it."""

    path: str
    relative: bool
    mode: str
    position: int  # -1: a character device (``/dev/null``), where there is nothing to seek
    content: Optional[bytes]  # the bytes of a file open for writing; None for a reading file
    encoding: Optional[str] = None  # text files only
    errors: Optional[str] = None
    raw: bool = False  # opened unbuffered (``buffering=0``)
    newline: Optional[str] = None  # text files: the ``newline`` argument (``""`` for a CSV file)
    line_buffering: bool = False  # text files opened with ``buffering=1``

    @property
    def absolute(self) -> str:
        return context.resolve_path(self.path, self.relative)


def is_open_file(obj: Any) -> bool:
    """True for an open file object of the ``open()`` kind (text, buffered or raw) over a file
    descriptor: not a text layer over a compressed stream (``gzip.open(p, "wt")``), whose
    compressor's state is not in the file."""
    if isinstance(obj, io.TextIOWrapper):
        inner = obj.buffer
        return isinstance(inner, (io.BufferedWriter, io.BufferedReader, io.BufferedRandom, io.FileIO)) \
            and not obj.closed
    return isinstance(obj, (io.BufferedWriter, io.BufferedReader, io.BufferedRandom, io.FileIO)) and not obj.closed


def writable(f: Any) -> bool:
    try:
        return bool(f.writable())
    except ValueError:
        return False


def capture(f: Any, content: bool = True) -> FileState:
    """The state of open file ``f`` (flushed first, so what it wrote is on disk); without
    ``content`` only the checks, no bytes read. Raises `FileNotCarried` for what cannot be
    re-opened."""
    name = getattr(f, "name", "?")
    try:
        fd = f.fileno()
        kind = os.fstat(fd).st_mode
        if stat.S_ISCHR(kind):  # /dev/null, a terminal's device: opened again by name, nowhere to seek
            return FileState(str(getattr(f, "name", "")), False, str(getattr(f, "mode", "w")), -1, None,
                             getattr(f, "encoding", None), getattr(f, "errors", None), isinstance(f, io.FileIO),
                             *_text_options(f))
        if not stat.S_ISREG(kind):
            raise FileNotCarried(f"{name!r} is not a regular file (a pipe, socket or terminal); open it in a "
                                 f"statement inside the loop, or close it before the loop")
        if writable(f):
            f.flush()
        position = f.tell()
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise FileNotCarried(f"the place in the open file {name!r} cannot be saved ({exc}: a library "
                             f"iterated it with next()); open it in a with statement around the loop "
                             f"(`with open(path) as f:`): a restore opens it again and takes the lines read "
                             f"before (with next() or the loop) again") from exc
    if path.endswith(" (deleted)"):
        raise FileNotCarried(f"the open file {name!r} was deleted from disk; a restore could not re-open it")
    data = None
    if writable(f):
        size = os.fstat(fd).st_size
        if size > MAX_CONTENT_BYTES:
            raise FileNotCarried(f"{name!r} is open for writing and holds {size >> 20} MiB, more than the "
                                 f"{MAX_CONTENT_BYTES >> 20} MiB a checkpoint copies; open it in append mode "
                                 f"inside the loop (`with open(path, 'a')` around each write)")
        if content:
            with open(f"/proc/self/fd/{fd}", "rb") as again:  # works for a write-only descriptor too
                data = again.read()
    rel, relative = context.relative_path(path)
    text = isinstance(f, io.TextIOWrapper)
    return FileState(rel, relative, str(getattr(f, "mode", "rb")), position, data,
                     f.encoding if text else None, f.errors if text else None, isinstance(f, io.FileIO),
                     *_text_options(f))


def _text_options(f: Any) -> tuple[Optional[str], bool]:
    """A text file's ``newline`` and line buffering, which a re-open must give it again."""
    if not isinstance(f, io.TextIOWrapper):
        return None, False
    try:
        newline = text_newline.newline_of(f)
    except text_newline.NewlineUnknown as exc:
        raise FileNotCarried(f"the newline {getattr(f, 'name', '?')!r} was opened with cannot be read here ({exc}); "
                             f"open it in binary mode, or in a with statement inside the loop") from exc
    return newline, bool(f.line_buffering)


def take_over(fresh: Any, handle: Any, where: str) -> Any:
    """A restore re-ran a with statement's header (``where``), which opened ``fresh`` (truncating
    a ``"w"`` file); the checkpoint's own ``handle`` for that file, which whatever else held it
    (a ``csv.writer``) refers to, continues instead: ``fresh`` is closed, and the bytes the load
    put back are put back again, with the position."""
    state = _reopened.get(handle)
    now = capture_path(fresh)
    fresh.close()
    if state is None:
        return handle
    if now is not None and now != state.absolute:
        warnings.warn(f"{where} opened {now!r}, but at the checkpoint it had {state.absolute!r} open; the "
                      f"job goes on with {state.absolute!r}", RuntimeWarning, stacklevel=3)
    if state.content is not None:
        _put_back(handle.fileno(), state.content, handle)
    if state.position >= 0:
        handle.seek(state.position)
    return handle


def capture_path(f: Any) -> Optional[str]:
    try:
        return os.readlink(f"/proc/self/fd/{f.fileno()}")
    except (OSError, ValueError):
        return None


def _put_back(fd: int, content: bytes, f: Any) -> None:
    f.flush()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view):]


def reopen(state: FileState) -> IO:
    """A new file object for ``state`` (what unpickling a saved open file calls)."""
    path = state.absolute
    if state.content is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as out:
            out.write(state.content)
    mode = state.mode
    if "w" in mode or "x" in mode:  # the file exists now and must not be truncated
        mode = "r+" + ("b" if "b" in mode else "")
    if "b" in mode:
        f = open(path, mode, buffering=0 if state.raw else -1)
    else:
        f = open(path, mode, buffering=1 if state.line_buffering else -1, encoding=state.encoding,
                 errors=state.errors, newline=state.newline)
    if ("a" not in mode or "+" in mode) and state.position >= 0:  # "a+" reads from its place; writes append
        f.seek(state.position)
    _reopened[f] = state
    return f


def reduce_memmap(obj: Any) -> Any:
    """A ``numpy.memmap`` of a whole file, saved as the file's name. A read-only one
    (``np.memmap("train.bin", mode="r")``, a dataset of tokens) is mapped again: a checkpoint would
    otherwise copy the whole dataset every time. A writable one (``mode="r+"``/``"w+"``,
    ``np.lib.format.open_memmap``: rows the loop writes out) is flushed and saved with the file's
    bytes, written back and mapped ``"r+"`` on load, like a file open for writing (it came back as
    an array in memory, and rows written after a restore never reached the file); over
    `MAX_CONTENT_BYTES` it is refused with advice. A view of one (``np.memmap(...).reshape(n, d)``,
    a slice) is saved as a view of the map, saved as above: saved as an array in memory, what the
    loop wrote through it after a restore never reached the file. Others (copy-on-write): NotImplemented."""
    import mmap

    root = obj
    while isinstance(root.base, type(obj)):
        root = root.base
    if root is not obj and isinstance(root.base, mmap.mmap):
        offset = obj.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        return _memmap_view, (root, offset, obj.shape, obj.strides, obj.dtype)
    mode = getattr(obj, "mode", None)
    if mode not in ("r", "r+", "w+") or not isinstance(obj.base, mmap.mmap) or not obj.filename:
        return NotImplemented
    path = os.path.realpath(obj.filename)
    rel, relative = context.relative_path(path)
    order = "F" if obj.flags.f_contiguous and not obj.flags.c_contiguous else "C"
    data = None
    if mode != "r":
        obj.flush()
        if os.path.getsize(path) > MAX_CONTENT_BYTES:
            raise pickle.PicklingError(
                f"cannot save the writable numpy.memmap of {path!r}: the file holds more than the "
                f"{MAX_CONTENT_BYTES >> 20} MiB a checkpoint copies; write its rows in pieces (np.save per "
                f"chunk) or map it only while writing, inside the loop body")
        with open(path, "rb") as f:
            data = f.read()
    return _reopen_memmap, (rel, relative, obj.dtype, obj.offset, obj.shape, order, os.path.getsize(path), data)


def _reopen_memmap(path: str, relative: bool, dtype: Any, offset: int, shape: tuple, order: str, size: int,
                   data: Optional[bytes] = None) -> Any:
    import numpy as np

    where = context.resolve_path(path, relative)
    if data is not None:  # a writable map: the file as it was at the checkpoint
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with open(where, "wb") as f:
            f.write(data)
        return np.memmap(where, dtype=dtype, mode="r+", offset=offset, shape=shape, order=order)
    _check_size(where, size, "maps", "numpy.memmap")
    return np.memmap(where, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)


def _memmap_view(root: Any, offset: int, shape: tuple, strides: tuple, dtype: Any) -> Any:
    import numpy as np

    view = np.ndarray.__new__(type(root), shape, dtype, buffer=root, offset=offset, strides=strides)
    for name in ("_mmap", "filename", "offset", "mode"):  # what numpy's own slicing copies
        setattr(view, name, getattr(root, name, None))
    return view


def reduce_temporary_directory(tmp: tempfile.TemporaryDirectory) -> tuple:
    """A ``tempfile.TemporaryDirectory`` (held across stops by its with statement: held_managers.py),
    saved with the files in it; made again at the same path by a restore, which may run on
    another node (PyTorch's transfer-learning tutorial keeps its best weights in one around the
    whole training loop). A stop leaves it to the stopping process's exit, which removes it."""
    files: dict[str, Optional[bytes]] = {}
    for folder, subfolders, names in os.walk(tmp.name):
        for name in subfolders:
            files[os.path.relpath(os.path.join(folder, name), tmp.name)] = None
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    files[os.path.relpath(path, tmp.name)] = f.read()
    return _temporary_directory, (tmp.name, files, getattr(tmp, "_ignore_cleanup_errors", False),
                                  getattr(tmp, "_delete", True))


def _temporary_directory(name: str, files: dict[str, Optional[bytes]], ignore_errors: bool,
                         delete: bool) -> tempfile.TemporaryDirectory:
    shutil.rmtree(name, ignore_errors=True)  # what a stopped process on this node left
    os.makedirs(name, mode=0o700)
    for relative, data in sorted(files.items()):
        path = os.path.join(name, relative)
        if data is None:
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    tmp = tempfile.TemporaryDirectory.__new__(tempfile.TemporaryDirectory)
    tmp.name = name
    tmp._ignore_cleanup_errors = ignore_errors  # type: ignore[attr-defined]
    extra = {}
    if sys.version_info >= (3, 12):
        tmp._delete = delete  # type: ignore[attr-defined]
        extra["delete"] = delete
    tmp._finalizer = weakref.finalize(  # type: ignore[attr-defined]
        tmp, tmp._cleanup, name, warn_message=f"Implicitly cleaning up {tmp!r}",  # type: ignore[attr-defined]
        ignore_errors=ignore_errors, **extra)
    return tmp


def reduce_npz(obj: Any) -> Any:
    """An open ``numpy.lib.npyio.NpzFile`` (``d = np.load("data.npz")`` kept in a variable), saved
    as its file's name and loaded again with ``np.load``: it holds an open zip archive, which no
    pickle can carry, so every checkpoint of a program holding one was refused. The file must be
    the same size on restore (a changed dataset is refused, as for a read-only memmap). A closed
    one pickles as it is; one over a stream that is not a file on disk: NotImplemented."""
    fid = getattr(obj, "fid", None)
    name = getattr(fid, "name", None)
    if fid is None or not isinstance(name, str) or not os.path.isfile(name):
        return NotImplemented
    path = os.path.realpath(name)
    rel, relative = context.relative_path(path)
    options = {"allow_pickle": bool(getattr(obj, "allow_pickle", False))}
    if hasattr(obj, "max_header_size"):
        options["max_header_size"] = obj.max_header_size
    return _reopen_npz, (rel, relative, os.path.getsize(path), options)


def _reopen_npz(path: str, relative: bool, size: int, options: dict[str, Any]) -> Any:
    import numpy as np

    where = context.resolve_path(path, relative)
    _check_size(where, size, "holds", "np.load of an .npz")
    return np.load(where, **options)


def _check_size(where: str, size: int, verb: str, what: str) -> None:
    """Refuse a restore whose input file (a dataset the job maps or holds open) changed size."""
    from ..checkpoint.errors import CheckpointError

    now = os.path.getsize(where) if os.path.exists(where) else None
    if now != size:
        raise CheckpointError(f"the job {verb} {where!r} ({what}), which held {size} bytes at the checkpoint and "
                              f"{'is missing' if now is None else f'holds {now}'} here; restore it as it was, or "
                              f"start the job over")


def reduce(obj: Any) -> Any:
    """The pickle reduction of an open regular file, or NotImplemented for other objects."""
    if not is_open_file(obj):
        return NotImplemented
    try:
        return reopen, (capture(obj),)
    except FileNotCarried as exc:
        raise pickle.PicklingError(str(exc)) from exc
