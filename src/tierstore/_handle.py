"""TensorHandle: what ``put`` returns; the entry lives exactly as long as the handle."""

from __future__ import annotations

from typing import NoReturn, SupportsIndex

import torch

__all__ = ["TensorHandle"]


class TensorHandle:
    """A reference to one stored tensor.

    The store keeps only a weak reference to each handle: when the last reference to a handle
    is dropped, its entry is released and every copy freed. Handles compare by identity.

    ``copy.copy`` and ``copy.deepcopy`` return the handle itself: a second object could not
    keep the entry alive, and the store would call it released. Pickling raises ``TypeError``:
    a handle names an entry in this process's store, which another process (or a later
    unpickling) cannot reach; ``get()`` the tensor and pickle that.

    Attributes:
        key: the entry's number, unique within its store.
        shape: the tensor's shape.
        dtype: the tensor's dtype.
        device: the device the tensor came from and returns to.
        nbytes: the tensor's size in bytes (elements times element size).
    """

    __slots__ = ("__weakref__", "_owner", "_released", "_shape", "device", "dtype", "key", "nbytes")

    def __init__(
        self,
        key: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        nbytes: int,
        owner: int,
    ) -> None:
        self.key = key
        self._shape = shape
        self.dtype = dtype
        self.device = device
        self.nbytes = nbytes
        self._owner = owner
        self._released = False

    def __copy__(self) -> TensorHandle:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> TensorHandle:
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            f"{self!r} cannot be pickled: it refers to an entry of a store in this process. "
            "Pickle the tensor instead (store.get(handle)), or keep the handle itself"
        )

    @property
    def shape(self) -> torch.Size:
        # Kept as a plain tuple, which the garbage collector stops tracking; see _Entry.shape.
        return torch.Size(self._shape)

    def __repr__(self) -> str:
        shape = "x".join(str(s) for s in self._shape) or "scalar"
        return (
            f"TensorHandle(#{self.key}, {shape}, {str(self.dtype).removeprefix('torch.')}, "
            f"{self.device}, {self.nbytes} bytes)"
        )
