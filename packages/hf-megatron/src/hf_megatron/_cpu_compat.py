"""The CPU compatibility layer: lets megatron-core 0.16 run on a machine without CUDA.

Why it exists: megatron-core is written for GPU clusters; HybridFlow's tests and small runs
must also work on CPU-only machines.  It is private (``_cpu_compat``) and switched on
explicitly: the engines enter :func:`cpu_device_mode` around their entry points, which does
nothing when CUDA is available, so a GPU user runs megatron unpatched.

megatron-core assumes a GPU in a handful of places that have nothing to do with the maths:
it asks ``torch.cuda`` for the current device, the RNG state and a synchronisation, and it
allocates buffers with ``device="cuda"`` / ``torch.cuda.current_device()`` or ``.cuda()``.
Everything else (the layers, the TP/PP collectives over gloo, the distributed optimizer,
the pipeline schedules) is device-agnostic.  This module redirects exactly those calls to the
CPU (measured to work: see docs/platform.md, "megatron-core on CPU").

Two parts for the device:

* :func:`install` patches a few ``torch.cuda`` functions and megatron's own CUDA RNG helpers,
  process-wide, once.  It refuses to run when CUDA is available: on a GPU nothing here is
  applied and megatron runs unchanged.
* :func:`cpu_device_mode` is a ``TorchFunctionMode`` that rewrites CUDA device arguments to the
  CPU while megatron code runs; the engine enters it around each of its entry points (it is
  thread-local, so it is entered per call rather than left on globally).

And one speed fix: :func:`install` also makes megatron's linear layers multiply 16-bit
tensors in float32 on CPUs without 16-bit instructions, where torch would emulate them.

``sequence_parallel`` is not supported on this path (the local layer spec has no CPU kernel
for it) and is rejected by the engine's config.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hf_core.device import cpu_lacks

log = logging.getLogger(__name__)

_INSTALLED = False


def needed() -> bool:
    """True when this process has no CUDA device, so megatron needs the layer."""
    return not torch.cuda.is_available()


# --------------------------------------------------------------------------- RNG
def _cpu_get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Stand-in for ``torch.cuda.get_rng_state`` and megatron's ``_get_cuda_rng_state``.

    megatron's ``CudaRNGStatesTracker`` forks a "CUDA" RNG for tensor-parallel regions
    (dropout, weight init); on the CPU the only generator is the CPU one, so the tracker
    forks that instead.  Weight init uses ``use_cpu_initialization`` and dropout is off in
    RL, so this changes no numbers the engine produces.
    """
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Stand-in for ``torch.cuda.set_rng_state`` and megatron's ``_set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed`` (called by ``model_parallel_cuda_manual_seed``): nothing
    to seed without a GPU; the CPU generator is seeded by the engine itself."""


def _current_device() -> int:
    """``torch.cuda.current_device`` raises without CUDA; megatron calls it to pick where
    buffers go.  Device index 0 is returned and :class:`_CpuDeviceMode` maps it to the CPU."""
    return 0


def _noop(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda.synchronize`` and similar: nothing to wait for on the CPU."""


# ----------------------------------------------------------------- device rewrite
def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments (what current_device() gives).
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (or an ordinal), ``.cuda()`` and ``.to("cuda")`` to CPU,
    and reports ``Tensor.type()`` under the CUDA names megatron checks for.

    Needed because megatron's DDP buffers, distributed optimizer and pipeline schedules
    allocate with ``device=torch.cuda.current_device()`` or call ``.cuda()``.
    """

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers and grad clipping dispatch on ``param.type()`` strings
            # ('torch.cuda.FloatTensor', ...): report the CPU tensor under its CUDA name.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Run the body with CUDA device arguments mapped to the CPU (a no-op with CUDA)."""
    if not needed():
        yield
        return
    install()
    with _CpuDeviceMode():
        yield


def on_cpu(method: Callable) -> Callable:
    """Decorator: run an engine method inside :func:`cpu_device_mode` (for a generator,
    every step of it: the mode is thread-local and must not leak into the caller)."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stepping(*args: Any, **kwargs: Any) -> Iterator[Any]:
            steps = method(*args, **kwargs)
            while True:
                with cpu_device_mode():
                    try:
                        item = next(steps)
                    except StopIteration:
                        return
                yield item

        return stepping

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cpu_device_mode():
            return method(*args, **kwargs)

    return wrapper


# ------------------------------------------------------------- 16-bit products
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _widened_matmul_applies(args: tuple) -> bool:
    """A 16-bit product this CPU has no instructions for, outside autograd's recording
    (a recorded product keeps torch's kernel rather than saving float32 copies)."""
    if len(args) != 2 or not all(isinstance(t, torch.Tensor) for t in args):
        return False
    a, b = args
    recording = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    on_cpu = a.device.type == "cpu" and b.device.type == "cpu"
    return not recording and a.dtype == b.dtype and on_cpu and cpu_lacks(a.dtype)


class _WidenedMatmuls(TorchFunctionMode):
    """``matmul`` of bfloat16 / float16 CPU tensors in float32, rounded once to the 16-bit
    type, on CPUs without instructions for it (``hf_core.device.cpu_lacks``; torch would
    emulate the product, an order of magnitude slower on an update)."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func in _MATMULS and not kwargs and _widened_matmul_applies(args):
            a, b = args
            return torch.matmul(a.float(), b.float()).to(a.dtype)
        return func(*args, **(kwargs or {}))


def _with_widened_matmuls(method: Callable) -> Any:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _WidenedMatmuls():
            return method(*args, **kwargs)

    return staticmethod(run)


def _widen_parallel_linear_products() -> None:
    """Run megatron's linear autograd functions (forward and backward) under
    :class:`_WidenedMatmuls`.  Their products run with autograd off, so widening them saves
    nothing extra; a mode entered around the engine would not reach the backward, which the
    autograd engine runs outside the caller's function modes."""
    from megatron.core.tensor_parallel import layers

    for function in (
        layers.LinearWithGradAccumulationAndAsyncCommunication,
        layers.LinearWithFrozenWeight,
    ):
        function.forward = _with_widened_matmuls(function.forward)
        function.backward = _with_widened_matmuls(function.backward)


def _with_device_mode(method: Callable) -> Any:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _CpuDeviceMode():
            return method(*args, **kwargs)

    return staticmethod(run)


def _backwards_on_cpu() -> None:
    """Run the backward of megatron's communication autograd functions (the tensor-parallel
    mappings; the MoE dispatcher's all-gather / reduce-scatter of tokens) under
    :class:`_CpuDeviceMode`: they allocate with ``device=torch.cuda.current_device()``, and
    the autograd engine runs a backward outside the caller's function modes."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    for module in (mappings, moe_utils):
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and issubclass(value, torch.autograd.Function)
                and value.__module__ == module.__name__
                and "backward" in vars(value)
            ):
                function: Any = value
                function.backward = _with_device_mode(vars(value)["backward"].__func__)


# ------------------------------------------------------------------------ install
def install() -> None:
    """Apply the process-wide patches (idempotent).  Only on a machine without CUDA."""
    global _INSTALLED
    if _INSTALLED:
        return
    if not needed():
        raise RuntimeError("the megatron CPU compatibility layer must not be used with CUDA")
    from megatron.core.tensor_parallel import random as mcore_random

    # megatron asks for the device to place buffers on; there is none without CUDA.
    torch.cuda.current_device = _current_device
    # Called around timers, optimizer steps and checkpoint code paths.
    torch.cuda.synchronize = _noop
    # The CUDA RNG API is used by model_parallel_cuda_manual_seed and the RNG tracker.
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    # megatron's own copies of the CUDA RNG helpers (they index torch.cuda.default_generators).
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # 16-bit GEMMs on CPUs without 16-bit instructions (a no-op per call on other CPUs).
    _widen_parallel_linear_products()
    # Collectives in backward passes (expert parallelism's token all-gather).
    _backwards_on_cpu()
    _INSTALLED = True
    log.info("megatron CPU compatibility layer installed (no CUDA device in this process)")
