"""Let a CPU-only torch build run autograd over tensors that report a ``cuda`` device.

Autograd asks two things of a device type before it runs a backward over it: a device guard
(to read a node's stream) and, since torch 2.8, that the type is *the* accelerator
(``at::getAccelerator()``, which on a CPU build names none). Both live in C++ registries with
no Python entry point for CUDA, so this module, for the simulator's lifetime only:

- puts a Python device guard (torch's own ``torch._C._acc.DeviceGuard``, whose stream and
  event calls are no-ops) into the CUDA slot of c10's guard registry;
- makes the CUDA hooks object report ``isBuilt()`` and ``hasPrimaryContext()`` by pointing
  it at a copy of its virtual table with those two entries replaced.

Both are undone by :func:`uninstall`. The addresses come from the symbol table of torch's
shared libraries; a build without one (or of another layout) raises :class:`Unsupported`,
and the simulator's tests skip with that reason.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any

import torch

__all__ = ["Unsupported", "install", "uninstall"]

_LIB = os.path.join(os.path.dirname(torch.__file__), "lib")
_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"
_GET_HOOKS = "_ZN2at6detail12getCUDAHooksEv"
_IS_BUILT = "_ZNK2at25AcceleratorHooksInterface7isBuiltEv"
_HAS_CONTEXT = "_ZNK2at18CUDAHooksInterface17hasPrimaryContextEa"
# Virtual-table slots after the two destructor entries: isBuilt, isAvailable, hasPrimaryContext.
_SLOT_IS_BUILT = 2
_SLOT_HAS_CONTEXT = 4
_CUDA = 1
_PRIVATE_USE1 = int(torch._C._autograd.DeviceType.PrivateUse1)

_BOOL = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
_BOOL_INDEX = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)
_keep: dict[str, Any] = {}


class Unsupported(RuntimeError):
    """This torch build cannot be made to run autograd over simulated device tensors."""


def _symbols(path: str, names: set[str]) -> dict[str, int]:
    """Values of ``names`` in the ELF symbol table (``.symtab``) of the library at ``path``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:5] != b"\x7fELF\x02":
            raise Unsupported(f"{path} is not a 64-bit ELF library")
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [
            struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
        ]
        found: dict[str, int] = {}
        for sh in sections:
            if sh[1] != 2:  # SHT_SYMTAB
                continue
            str_off, str_size = sections[sh[6]][4], sections[sh[6]][5]
            strtab = data[str_off : str_off + str_size]
            wanted = {}
            for name in names:
                at = strtab.find(b"\0" + name.encode() + b"\0")
                if at >= 0:
                    wanted[at + 1] = name
            symtab = data[sh[4] : sh[4] + sh[5]]
            for name_at, _, _, _, value, _ in struct.iter_unpack("<IBBHQQ", symtab):
                if name_at in wanted:
                    found[wanted[name_at]] = value
    missing = names - found.keys()
    if missing:
        raise Unsupported(f"symbols {sorted(missing)} not found in {os.path.basename(path)}")
    return found


class _CudaGuard(torch._C._acc.DeviceGuard):  # type: ignore[misc]
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.CUDA


def _prepare() -> None:
    if _keep:
        return
    c10 = ctypes.CDLL(os.path.join(_LIB, "libc10.so"))
    cpu = ctypes.CDLL(os.path.join(_LIB, "libtorch_cpu.so"))
    registry = (ctypes.c_void_p * 64).in_dll(c10, _REGISTRY)
    if registry[_CUDA]:
        raise Unsupported("this torch build has a CUDA runtime; run the tests on the GPU instead")
    if registry[_PRIVATE_USE1]:
        raise Unsupported("a PrivateUse1 device guard is registered already")
    guard = _CudaGuard()
    torch._C._acc.register_python_privateuseone_device_guard(guard)
    guard_ptr, registry[_PRIVATE_USE1] = registry[_PRIVATE_USE1], None

    syms = _symbols(os.path.join(_LIB, "libtorch_cpu.so"), {_GET_HOOKS, _IS_BUILT, _HAS_CONTEXT})
    get_hooks = getattr(cpu, _GET_HOOKS)
    get_hooks.restype = ctypes.c_void_p
    base = ctypes.cast(get_hooks, ctypes.c_void_p).value - syms[_GET_HOOKS]  # type: ignore[operator]
    hooks = get_hooks()
    vptr = ctypes.c_void_p.from_address(hooks).value
    assert vptr is not None
    table = (ctypes.c_void_p * 256).from_address(vptr - 16)
    if (
        table[2 + _SLOT_IS_BUILT] != base + syms[_IS_BUILT]
        or table[2 + _SLOT_HAS_CONTEXT] != base + syms[_HAS_CONTEXT]
    ):
        raise Unsupported("the CUDA hooks' virtual table has another layout in this torch build")
    copy = (ctypes.c_void_p * 256)(*table)
    built, context = _BOOL(lambda _self: True), _BOOL_INDEX(lambda _self, _i: True)
    copy[2 + _SLOT_IS_BUILT] = ctypes.cast(built, ctypes.c_void_p).value
    copy[2 + _SLOT_HAS_CONTEXT] = ctypes.cast(context, ctypes.c_void_p).value
    _keep.update(
        guard=guard,
        guard_ptr=guard_ptr,
        registry=registry,
        hooks=hooks,
        vptr=vptr,
        copy=copy,
        callbacks=(built, context),
    )


def install() -> None:
    """Make ``cuda`` tensors usable by autograd in this process until :func:`uninstall`.

    Raises:
        Unsupported: this torch build cannot be patched (see the module docstring).
    """
    _prepare()
    _keep["registry"][_CUDA] = _keep["guard_ptr"]
    ctypes.c_void_p.from_address(_keep["hooks"]).value = ctypes.addressof(_keep["copy"]) + 16


def uninstall() -> None:
    """Undo :func:`install`: the process has no CUDA again."""
    if _keep:
        ctypes.c_void_p.from_address(_keep["hooks"]).value = _keep["vptr"]
        _keep["registry"][_CUDA] = None
