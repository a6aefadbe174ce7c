"""Eager torch without importing ``torch._dynamo`` in a training rank.

torch 2.13 wraps many of its own functions in ``torch._disable_dynamo`` (the optimizers'
``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict``, the dispatch
mode of ``FlopCounterMode``, the Python references that shape-only ``meta`` tensors run)
and every optimizer ``step`` in ``_use_grad_for_differentiable``. Both import
``torch._dynamo`` (with sympy and FSDP) at their first call: on this project's CPUs about
1.7 s of each rank's start-up, against about 2 s for ``import torch``. The wrappers only
keep the compiler from tracing those functions, and a training rank does not compile, so:

- :func:`skip_wrappers` marks every ``_disable_dynamo`` wrapper in the process as disabled
  already (the wrapper caches the disabled function in
  ``fn.__dynamo_disable``; given ``fn`` itself, it calls ``fn``);
- :func:`optimizer` gives the instance a ``step`` that runs the class's own update under
  ``torch.no_grad()`` between its step hooks, as ``_use_grad_for_differentiable`` does
  outside compilation, less its two ``graph_break`` calls.

The arithmetic is torch's own: the same functions with the same arguments. Where a torch
has none of these wrappers, both leave it as it is. Only the training process calls them
(``export-onnx``, which may trace, does not).
"""

from __future__ import annotations

import functools
import gc
import sys
import types
from itertools import chain
from typing import Callable

import torch
from torch.optim import optimizer as _optimizer

_scanned_with = -1   # len(sys.modules) at the last scan: wrappers are made as modules load


@functools.cache
def _inner_code() -> types.CodeType | None:
    """The code of the wrapper ``torch._disable_dynamo(fn)`` returns, where it keeps ``fn``
    in its closure and looks up ``fn.__dynamo_disable`` (else None)."""
    make = getattr(torch, "_disable_dynamo", None)
    code = getattr(make(lambda: None), "__code__", None) if make is not None else None
    if code is None or "fn" not in code.co_freevars or "__dynamo_disable" not in code.co_names:
        return None
    return code


def skip_wrappers() -> int:
    """Mark every ``_disable_dynamo`` wrapper alive in this process (the garbage collector
    tracks them all) as disabled already; the number newly marked. The scan (about 50 ms)
    runs again only when modules were imported since the last one, as torch makes its
    wrappers when its modules load (a dispatch mode's, when its class is defined)."""
    global _scanned_with
    inner = _inner_code()
    if inner is None or "torch._dynamo" in sys.modules or len(sys.modules) == _scanned_with:
        return 0
    _scanned_with = len(sys.modules)
    slot = inner.co_freevars.index("fn")    # the wrapped function, as the wrapper sees it
    marked = 0
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType and obj.__code__ is inner:
            fn = obj.__closure__[slot].cell_contents
            if getattr(fn, "__dynamo_disable", None) is None:
                fn.__dynamo_disable = fn
                marked += 1
    return marked


def _own_update(cls: type) -> Callable | None:
    """``cls.step`` under ``_use_grad_for_differentiable`` (and the step-hook wrapper torch
    adds to the class), or None where that wrapper is not there."""
    outer = vars(cls).get("step")
    chain_ = []
    while outer is not None:
        chain_.append(outer)
        outer = getattr(outer, "__wrapped__", None)
    if len(chain_) < 2:
        return None
    guard = chain_[-2]                       # the wrapper right around the update
    names = getattr(getattr(guard, "__code__", None), "co_names", ())
    if "graph_break" not in names:
        return None
    return chain_[-1]


def optimizer(cls: type, params, **options) -> torch.optim.Optimizer:
    """``cls(params, **options)``, stepped without ``torch._dynamo`` where torch 2.13's
    wrappers are there (see the module's docstring)."""
    skip_wrappers()
    opt = cls(params, **options)
    update = _own_update(cls)
    if update is None:
        return opt

    @functools.wraps(update)
    def step(*args, **kwargs):
        for hook in chain(_optimizer._global_optimizer_pre_hooks.values(),
                          opt._optimizer_step_pre_hooks.values()):
            result = hook(opt, args, kwargs)
            if result is not None:
                args, kwargs = result
        with torch.set_grad_enabled(bool(opt.defaults.get("differentiable", False))):
            out = update(opt, *args, **kwargs)
        for hook in chain(opt._optimizer_step_post_hooks.values(),
                          _optimizer._global_optimizer_post_hooks.values()):
            hook(opt, args, kwargs)
        return out

    opt.step = step
    return opt
