"""Hugging Face transformers: offloaded checkpointing, the Trainer's own switch, and a callback.

transformers is imported by nothing here at module level: this module imports without it.

Note: [The Trainer's own switch]
    ``Trainer`` with ``activation_checkpointing=True`` (alias ``gradient_checkpointing``) calls
    ``model.activation_checkpointing_enable(kwargs)`` when training starts
    (``gradient_checkpointing_enable`` in transformers before the rename: 5.17 has only the
    old names, 5.24 both), and that installs torch's checkpoint over ours: the store then
    received nothing, and nothing said so. :func:`enable_offloaded_checkpointing` therefore
    also replaces those methods, where the model's class has them, on the model instance (not
    its class), so the Trainer's call installs tierstore's checkpoint again, with the
    Trainer's ``gradient_checkpointing_kwargs`` passed through. ``*_checkpointing_disable``
    removes the replacements and turns checkpointing off.

Note: [A wrapped model]
    PEFT's ``PeftModel`` and ``torch.compile``'s ``OptimizedModule`` forward attributes they
    lack to the model they wrap, so the guards above passed on them, but their classes do not
    have the methods to replace: the Trainer's ``activation_checkpointing_enable`` reached the
    wrapped model's own method, which put torch's checkpoint back on every layer, and the
    store received nothing. The replacements therefore go on the wrapped transformers model,
    where the wrapper's forwarding finds them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tierstore.adapters import checkpoint, no_offload, offload_activations
from tierstore.adapters._common import check_store, resolve_store

if TYPE_CHECKING:
    from types import TracebackType

    from torch.utils.hooks import RemovableHandle

    from tierstore._stats import StoreStats
    from tierstore._sync import TieredStore

log = logging.getLogger("tierstore")

# TierStoreCallback is made on first use (module __getattr__): it subclasses transformers'.
__all__ = [  # noqa: F822
    "TierStoreCallback",
    "attach_callback",
    "enable_offloaded_checkpointing",
    "offloading_context",
]

_METHODS = (
    "activation_checkpointing_enable",
    "gradient_checkpointing_enable",
    "activation_checkpointing_disable",
    "gradient_checkpointing_disable",
)


def enable_offloaded_checkpointing(
    model: torch.nn.Module, store: TieredStore | None = None, *, every_n_layers: int = 1
) -> None:
    """Turn on activation checkpointing of ``model`` with :func:`tierstore.checkpoint`.

    Each decoder layer then keeps nothing for backward but its inputs (hidden states, the
    attention mask, position embeddings), and those live in ``store``: on a GPU they leave the
    device, and past the host tier's capacity they spill to disk. The layers recompute in
    backward with the forward's RNG state, so gradients are bit-identical to no checkpointing,
    dropout included. Works with ``Trainer``, with or without its own
    ``activation_checkpointing=True`` (alias ``gradient_checkpointing``): when the Trainer turns
    checkpointing on, tierstore's checkpoint is what it installs, with its
    ``gradient_checkpointing_kwargs`` (Note: [The Trainer's own switch]).
    ``model.activation_checkpointing_disable()`` (``gradient_checkpointing_disable()``) turns
    it off again.

    Args:
        model: a ``transformers.PreTrainedModel`` that supports gradient checkpointing.
        store: where layer inputs go; ``None`` means :func:`tierstore.default_store`, resolved
            at the first checkpointed forward.
        every_n_layers: checkpoint every n-th decoder layer only (default 1: all of them); the
            others keep their activations as usual. Needs a transformers version whose
            ``_set_gradient_checkpointing`` accepts it. It stands when the Trainer turns
            checkpointing on, which passes 1 when its kwargs name no count; a count other than
            1 passed to ``model.activation_checkpointing_enable`` replaces it. To go back to
            every layer, call this function again with 1.

    Raises:
        ValueError: the model does not support gradient checkpointing, uses the pre-4.35
            checkpointing format (a ``_set_gradient_checkpointing(module, value)`` override),
            ``every_n_layers`` is not a positive integer, or is not supported by this
            transformers version.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> import tierstore, tierstore.integrations.transformers as tt
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
        >>> tt.enable_offloaded_checkpointing(model, tierstore.TieredStore(min_bytes=0))
        >>> model.is_activation_checkpointing  # is_gradient_checkpointing before 5.17
        True
    """
    _check_every_n_layers(every_n_layers)
    check_store(store)
    model = _wrapped_model(model)  # Note: [A wrapped model]
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is False); wrap its layers with "
            "tierstore.checkpoint yourself"
        )
    setter: Any = getattr(model, "_set_gradient_checkpointing", None)
    if setter is None or "value" in inspect.signature(setter).parameters:
        raise ValueError(
            f"{type(model).__name__} uses the checkpointing format of transformers < 4.35, "
            "which cannot take a checkpoint function; update the model's code"
        )
    _install(model, store, {}, every_n_layers)
    for name in _METHODS:
        if getattr(type(model), name, None) is not None:
            # On the instance, so the class and other models stay as they are.
            object.__setattr__(model, name, _Method(model, name, store, every_n_layers))


class _Method:
    """One of the checkpointing methods, replaced on one model instance (Note: [The Trainer's
    own switch]).

    Note: [Replaced methods travel with the model]
        A copy of the model must checkpoint into the same store and switch itself, and so
        must a model saved whole and loaded back (``torch.save(model)``). A bound method
        (``types.MethodType``) deep-copies right, but pickles as ``getattr(model, name)``,
        which unpickling calls before it restores the model's ``__dict__``: it found
        transformers' own method and stored that on the instance, so the loaded model's next
        enable put torch's checkpoint on every layer, and the store received nothing. This
        object pickles as what rebuilds it on the loaded model, and deep-copies onto the copy
        sharing the store (a store cannot be copied, nor pickled: a model enabled with a
        store of its own pickles only with the default store).

    ``inspect.signature`` shows the method's own parameters, not the keywords bound here
    (PEFT and the Trainer read them), and ``__name__`` is the method's.
    """

    def __init__(
        self, model: torch.nn.Module, name: str, store: TieredStore | None, chosen: int
    ) -> None:
        # Weakly: the model holds this object, and a strong reference back made a cycle that
        # kept ``del model`` from freeing the weights until the collector ran.
        self._model_ref = weakref.ref(model)
        self._name, self._store, self._chosen = name, store, chosen
        enable = functools.partial(_enable, store=store, chosen=chosen)
        self._fn: Callable[..., None] = {
            "activation_checkpointing_enable": enable,
            "gradient_checkpointing_enable": functools.partial(_enable_legacy, enable=enable),
        }.get(name, _disable)
        own = inspect.signature(getattr(type(model), name))
        self.__signature__ = own.replace(parameters=list(own.parameters.values())[1:])
        self.__name__ = self.__qualname__ = name

    @property
    def _model(self) -> torch.nn.Module:
        model = self._model_ref()
        if model is None:  # only reachable through a reference kept to this object itself
            raise ReferenceError(f"{self._name}: the model it belonged to was deleted")
        return model

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        """Switch the model; nothing when it is gone (Note: [A method outliving its model])."""
        try:
            self.__signature__.bind(*args, **kwargs)
        except TypeError as err:  # named as the method called, not the function behind it
            raise TypeError(f"{self._name}(): {err}") from None
        # Note: [A method outliving its model]
        #     Unlike a bound method, this object holds its model weakly, so the model of
        #     ``copy.deepcopy(model).gradient_checkpointing_enable()`` is freed as soon as the
        #     method is looked up, before the call. A bound method would have switched a model
        #     nobody can reach; doing nothing is the same, where raising broke the call.
        model = self._model_ref()
        if model is not None:
            self._fn(model, *args, **kwargs)

    def __reduce__(self) -> tuple[type[_Method], tuple[Any, ...]]:
        return _Method, (self._model, self._name, self._store, self._chosen)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Method:
        twin = copy.deepcopy(self._model, memo)
        return _Method(twin, self._name, self._store, self._chosen)


def _wrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT or ``torch.compile`` wrapper (Note: [A wrapped
    model]); ``model`` itself when it is not such a wrapper."""
    for _ in range(8):  # a compiled PEFT model is two wrappers deep
        if hasattr(type(model), "_set_gradient_checkpointing"):
            return model
        get_base: Any = getattr(type(model), "get_base_model", None)
        if (parallel := _parallel_inner(model)) is not None:  # DDP, FSDP, torch.compile
            inner: Any = parallel
        elif get_base is not None:
            inner = get_base(model)
        else:  # PEFT's tuner models and mixed models
            inner = next(
                (
                    child
                    for name in ("model", "base_model")
                    if isinstance(child := getattr(model, name, None), torch.nn.Module)
                ),
                None,
            )
        if not isinstance(inner, torch.nn.Module) or inner is model:
            return model
        model = inner
    return model


def _check_every_n_layers(every_n_layers: object) -> None:
    if (
        isinstance(every_n_layers, bool)
        or not isinstance(every_n_layers, int)
        or every_n_layers < 1
    ):
        raise ValueError(
            f"every_n_layers={every_n_layers!r}: checkpoint every n-th decoder layer, n a "
            "positive integer (1, the default, checkpoints every layer)"
        )


def _enable(
    model: torch.nn.Module,
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    every_n_layers: int | None = None,
    offload: bool = False,
    *,
    store: TieredStore | None,
    chosen: int,
) -> None:
    """``model.activation_checkpointing_enable`` once tierstore's checkpoint is installed.

    Takes the parameters transformers' method takes, and no others: a misspelt keyword
    raises ``TypeError``, as it does without tierstore.
    """
    # ``offload`` asks transformers to keep inputs in pinned host memory: the store does.
    del offload
    if every_n_layers is not None:
        _check_every_n_layers(every_n_layers)
    # The Trainer passes 1 unless its kwargs name a count (transformers 5.24), or nothing
    # (5.17): the count chosen at install stands then; another count given here wins.
    n = chosen if every_n_layers in (None, 1) else every_n_layers
    assert n is not None
    _install(model, store, activation_checkpointing_kwargs or {}, n)
    _enable_input_grads(model)


def _enable_legacy(
    model: torch.nn.Module,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    *,
    enable: Callable[..., None],
    **kw: Any,
) -> None:
    """``model.gradient_checkpointing_enable``: the name before transformers renamed it.

    Raises:
        TypeError: a keyword the new name does not take, named as transformers names it.
    """
    for key in kw:
        if key not in _ENABLE_KEYWORDS:
            raise TypeError(
                f"activation_checkpointing_enable() got an unexpected keyword argument {key!r}"
            )
    enable(model, gradient_checkpointing_kwargs, **kw)


_ENABLE_KEYWORDS = frozenset(inspect.signature(_enable).parameters) - {
    "model", "activation_checkpointing_kwargs", "store", "chosen",
}  # fmt: skip
"""What ``activation_checkpointing_enable`` takes besides its kwargs, which the legacy name
forwards to it."""


def _disable(model: torch.nn.Module) -> None:
    """``model.*_checkpointing_disable``: remove the replacements, checkpoint no more."""
    for name in _METHODS:
        model.__dict__.pop(name, None)
    setter: Any = model._set_gradient_checkpointing
    setter(enable=False)


def _install(
    model: torch.nn.Module, store: TieredStore | None, kwargs: dict[str, Any], every_n_layers: int
) -> None:
    setter: Any = model._set_gradient_checkpointing
    func = functools.partial(checkpoint, store=store, **kwargs)
    if every_n_layers == 1:
        setter(enable=True, gradient_checkpointing_func=func)
        return
    if "every_n_layers" not in inspect.signature(setter).parameters:
        raise ValueError(
            f"every_n_layers={every_n_layers!r}: this transformers version checkpoints "
            "every layer or none"
        )
    setter(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)


def _enable_input_grads(model: torch.nn.Module) -> None:
    # As transformers does when it turns checkpointing on for a model fed token ids (or with
    # PEFT adapters): the embeddings' output requires grad. Values are unchanged.
    input_ids = getattr(model, "main_input_name", None) == "input_ids"
    enable: Any = getattr(model, "enable_input_require_grads", None)
    if (input_ids or getattr(model, "_hf_peft_config_loaded", False)) and enable is not None:
        enable()


class _StoreFigures:
    """What ``TierStoreCallback`` does; transformers' base class is added when the callback is
    first imported, so that this module imports without transformers."""

    def __init__(self, store: TieredStore | None = None) -> None:
        self._store_arg = store
        self._last: StoreStats | None = None
        self._last_step = 0
        self._peak_off_device = 0  # the highest step peak since the last log

    def figures(self, step: int) -> dict[str, float]:
        """The store's figures per step since the last call (cumulative for errors)."""
        now = resolve_store(self._store_arg).stats()
        then, counts = _Counts.of(self._last), _Counts.of(now)
        self._last = now
        peak, self._peak_off_device = self._peak_off_device, 0
        steps = max(1, step - self._last_step)
        self._last_step = step
        gib, mib = float(1 << 30), float(1 << 20)
        return {
            "tierstore/offloaded_gib": (counts.put - then.put) / steps / gib,
            "tierstore/host_gib": (counts.host - then.host) / steps / gib,
            "tierstore/disk_gib": (counts.disk - then.disk) / steps / gib,
            "tierstore/backward_wait_s": (counts.wait - then.wait) / steps,
            "tierstore/skipped_mib": (counts.skipped - then.skipped) / steps / mib,
            "tierstore/peak_off_device_gib": peak / gib,
            "tierstore/read_errors": float(now.read_errors),
            "tierstore/write_errors": float(now.write_errors),
        }

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = resolve_store(self._store_arg).stats()
        self._last_step = state.global_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # One line per optimizer step on the "tierstore" logger, at INFO.
        step = resolve_store(self._store_arg).end_step(state.global_step)
        self._peak_off_device = max(self._peak_off_device, step.peak_off_device_bytes)
        log.info("%s", step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if logs is None or "loss" not in logs:
            return  # an evaluation's or the run summary's log: nothing trained since
        figures = self.figures(state.global_step)
        logs.update(figures)
        if state.log_history:
            state.log_history[-1].update(figures)


class _Counts(NamedTuple):
    """The cumulative counters the callback reports differences of."""

    put: float
    host: float
    disk: float
    wait: float
    skipped: float

    @classmethod
    def of(cls, s: StoreStats | None) -> _Counts:
        if s is None:
            return cls(0, 0, 0, 0.0, 0)
        skipped = sum(s.skipped_bytes.values())
        # Host: what reached the host tier and went no further; disk: the true bytes written.
        host = s.host.total_bytes - s.bytes_to_disk
        return cls(s.bytes_put, host, s.bytes_to_disk, s.get_wait_seconds, skipped)


@functools.cache
def _callback_class() -> type[_StoreFigures]:
    from transformers import TrainerCallback

    class TierStoreCallback(_StoreFigures, TrainerCallback):
        """A ``transformers.TrainerCallback`` that puts the store's figures into the logs.

        At the end of every optimizer step it ends the store's step
        (:meth:`tierstore.TieredStore.end_step`, numbered by ``state.global_step``) and logs
        its one line on the ``tierstore`` logger at INFO: ``tierstore: step 12 offloaded 3.1
        GiB (host 2.0, disk 1.1), peak off-device 2.9 GiB, backward waited 0.04 s, skipped
        12 MiB (parameters 10, small 2.0)``; a step that stored nothing warns once per store.

        At every logging step it adds, per optimizer step since the last log:
        ``tierstore/offloaded_gib`` (bytes handed to the store), ``tierstore/host_gib`` (of
        those, kept in host memory) and ``tierstore/disk_gib`` (written to disk),
        ``tierstore/backward_wait_s`` (seconds backward waited for tensors to come back) and
        ``tierstore/skipped_mib`` (bytes left where they were); the highest of those steps'
        peaks of bytes held off the device, ``tierstore/peak_off_device_gib``; and,
        cumulatively, ``tierstore/read_errors`` and ``tierstore/write_errors``. They go into
        the ``logs`` that later callbacks see and into ``state.log_history``;
        :func:`attach_callback` puts it first, so that the console line and every reporter
        (TensorBoard, W&B, ...) show them too.

        Args:
            store: the store to report on; ``None`` means :func:`tierstore.default_store`.
        """

    TierStoreCallback.__qualname__ = "TierStoreCallback"
    return TierStoreCallback


def __getattr__(name: str) -> Any:
    if name == "TierStoreCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attach_callback(trainer: Any, store: TieredStore | None = None) -> Any:
    """Add a ``TierStoreCallback`` to ``trainer`` ahead of its other callbacks.

    First, so that the console line, ``state.log_history`` and every reporter see its figures.

    Returns:
        The callback.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=data)  # doctest: +SKIP
        >>> attach_callback(trainer, store)  # doctest: +SKIP
    """
    callback = _callback_class()(store)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


class offloading_context:
    """TRL's and torchtune's activation offloading for a model, backed by a store.

    What ``get_act_offloading_ctx_manager(model)`` returns in TRL and torchtune, in one line:
    :func:`tierstore.offload_activations` over the whole forward, except the output head,
    whose activations backward needs first and which those tools leave in place with their
    ``NoOpManager`` (here :func:`tierstore.no_offload`). With TRL's ``SFTTrainer``, set
    ``trainer.maybe_activation_offload_context = offloading_context(trainer.model, store)``
    instead of ``activation_offloading=True``; in a torchtune recipe, use it where the recipe
    builds its offloading context.

    Args:
        model: the model; for a ``transformers.PreTrainedModel`` the head is
            ``get_output_embeddings()``, otherwise the last child module.
        store: where activations go; ``None`` means :func:`tierstore.default_store`.
        min_bytes: tensors smaller than this stay in place (torchtune's ``min_offload_size``);
            ``None`` means the store's ``min_bytes``.
        keep_output_head: leave the head's activations in place (default True).

    Raises:
        ValueError: ``min_bytes`` is negative or not an integer.

    Like :func:`~tierstore.offload_activations`, one object may be entered again while open,
    and by several threads at once: the head's hooks stay on it from the first enter to the
    last exit, and act only in the threads inside the block.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        store: TieredStore | None = None,
        *,
        min_bytes: int | None = None,
        keep_output_head: bool = True,
    ) -> None:
        self._offload = offload_activations(store, min_bytes=min_bytes)
        self._head = _output_head(model) if keep_output_head else None
        self._handles: list[RemovableHandle] = []
        self._lock = threading.Lock()
        self._entered = 0  # enters not yet exited, over every thread
        self._here = threading.local()

    def _thread(self) -> _HeadBlocks:
        here: _HeadBlocks | None = getattr(self._here, "blocks", None)
        if here is None:
            here = self._here.blocks = _HeadBlocks()
        return here

    def __enter__(self) -> offloading_context:
        self._offload.__enter__()
        if self._head is not None:
            self._thread().marks.append(len(self._thread().inside))
            with self._lock:
                self._entered += 1
                if self._entered == 1:
                    self._handles = [
                        self._head.register_forward_pre_hook(self._keep),
                        self._head.register_forward_hook(self._resume, always_call=True),
                    ]
        return self

    def _keep(self, module: torch.nn.Module, args: Any) -> None:
        here = self._thread()
        if not here.marks:  # the head called by a thread outside this block
            return
        inner = no_offload()
        inner.__enter__()
        here.inside.append(inner)

    def _resume(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        here = self._thread()
        if len(here.inside) > (here.marks[-1] if here.marks else 0):
            here.inside.pop().__exit__(None, None, None)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._head is not None:
                here = self._thread()
                mark = here.marks.pop()
                while len(here.inside) > mark:  # a head that raised before its hook ran
                    here.inside.pop().__exit__(None, None, None)
                with self._lock:
                    self._entered -= 1
                    if self._entered == 0:
                        for handle in self._handles:
                            handle.remove()
                        self._handles = []
        finally:
            self._offload.__exit__(exc_type, exc, tb)


class _HeadBlocks:
    """One thread's state in an :class:`offloading_context`: where each of its open enters
    began (``marks``) and the ``no_offload`` blocks open around the head (``inside``)."""

    __slots__ = ("inside", "marks")

    def __init__(self) -> None:
        self.marks: list[int] = []
        self.inside: list[Any] = []


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output head: ``get_output_embeddings()``, else its last child, looked for
    inside data-parallel and ``torch.compile`` wrappers (whose only child is the whole model:
    kept out of offloading, it kept everything). None, with a warning, where the model's one
    child is all there is."""
    model = _unwrapped(model)
    get: Any = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        children = list(model.children())
        if len(children) == 1:
            warnings.warn(
                f"tierstore: offloading_context cannot tell the output head of "
                f"{type(model).__name__}, whose one child is the whole model; nothing is kept "
                "out of offloading. Pass keep_output_head=False to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        head = children[-1] if children else None
    return head


def _parallel_inner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``DistributedDataParallel``, ``DataParallel``, FSDP (its first version)
    or ``torch.compile`` wrapper holds; None when ``model`` is no such wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DataParallel, DistributedDataParallel)):
        inner: object = model.module
    else:
        inner = getattr(model, "_fsdp_wrapped_module", None)
        if inner is None:  # not ``or``: an empty container is falsy
            inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) and inner is not model else None


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without its data-parallel and ``torch.compile`` wrappers."""
    for _ in range(8):
        inner = _parallel_inner(model)
        if inner is None:
            break
        model = inner
    return model
