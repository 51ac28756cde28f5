"""What a store is to ``copy`` and ``pickle``: the very object, and nothing to send."""

from __future__ import annotations

from typing import NoReturn, SupportsIndex, TypeVar

__all__ = ["ProcessBound"]

T = TypeVar("T", bound="ProcessBound")


class ProcessBound:
    """Note: [A copy of a store is the store]
    A store is this process's resource: its thread, its spill files, its entries. A copy of
    something that refers to it (``copy.deepcopy(model)`` once its layers checkpoint into a
    store, an optimizer's ``param_groups``) refers to the same store, as a copied handle is
    the handle. Pickling raises: another process has no use for it.
    """

    __slots__ = ()

    def __copy__(self: T) -> T:
        return self

    def __deepcopy__(self: T, memo: dict[int, object]) -> T:
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: it is this process's threads, memory "
            "and spill files. Create a store in the other process (or use "
            "tierstore.default_store() there)"
        )
