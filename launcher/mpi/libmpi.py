"""Which file really is this process's MPI library: ask the dynamic linker, not file names.

:func:`libmpi_path` is the shared object that defines ``MPI_Init`` for this process's MPI,
found as mpi4py's ``python -m mpi4py --mpi-library`` does: look the symbol up (``dlsym``)
and ask ``dladdr`` which loaded object holds its address. :func:`defining_library` does the
same for any symbol (``fi_getinfo``: libfabric, ``ucp_init_version``: UCX, ...).

The lookup goes through mpi4py's extension module first when it is loaded (its ``DT_NEEDED``
libmpi is the one mpi4py calls, even where another libmpi is mapped as well), then through
every object the process has loaded, in load order (``dl_iterate_phdr``), so it also finds a
libmpi loaded privately (``RTLD_LOCAL``) by another extension, e.g. Horovod's. Paths come
back with symlinks resolved (``libmpi.so.40`` -> ``libmpi.so.40.30.4``). No torch, no mpi4py
import: the probe, the training records and test programs use it alike.
"""

from __future__ import annotations

import ctypes
import os
import sys

_RTLD_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


class _DlPhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p),
                ("dlpi_phdr", ctypes.c_void_p), ("dlpi_phnum", ctypes.c_uint16)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t,
                                  ctypes.c_void_p)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.dladdr.restype = ctypes.c_int
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    libc.dl_iterate_phdr.restype = ctypes.c_int
    libc.dl_iterate_phdr.argtypes = [_PHDR_CALLBACK, ctypes.c_void_p]
    return libc


def loaded_objects() -> list[str]:
    """File names of the shared objects loaded into this process, in load order."""
    names: list[str] = []

    def collect(info, _size, _data) -> int:
        name = info.contents.dlpi_name
        if name:
            names.append(os.fsdecode(name))
        return 0

    _libc().dl_iterate_phdr(_PHDR_CALLBACK(collect), None)
    return names


def _scopes() -> list[str]:
    """Where to look a symbol up, in order: mpi4py's MPI module, then every loaded object."""
    mpi = sys.modules.get("mpi4py.MPI")
    first = [mpi.__file__] if mpi is not None and getattr(mpi, "__file__", None) else []
    return [*first, *loaded_objects()]


def defining_library(symbol: str) -> str | None:
    """The file (symlinks resolved) of the loaded object that defines ``symbol``, or None
    when no loaded object defines it."""
    libc = _libc()
    for name in _scopes():
        try:
            handle = ctypes.CDLL(name, mode=_RTLD_NOLOAD | os.RTLD_LAZY)
            address = ctypes.cast(getattr(handle, symbol), ctypes.c_void_p)
        except (OSError, AttributeError):
            continue
        info = _DlInfo()
        if libc.dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    return None


def libmpi_path() -> str | None:
    """The file of the MPI library this process really uses (it defines ``MPI_Init``)."""
    return defining_library("MPI_Init")
