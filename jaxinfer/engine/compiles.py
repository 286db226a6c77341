"""Counting the executables an engine's jitted steps build, exactly.

``jax.jit``'s own ``_cache_size()`` counts entries of its C++ dispatch cache, which keys on
more than the shapes (whether an argument is committed to a device, for one): the same step
shape could leave one entry or three, depending on what ran before in the process, so a
test could only bound it. What costs time is building an executable: JAX lowers a jaxpr to
an MLIR module once per executable (before compiling it, or loading it from the persistent
compilation cache) and records a monitoring event each time. A ``CompileCounter`` counts
those events while one of its wrapped functions is being called on this thread, so each
engine counts only its own executables, however many engines a process holds.
"""

from __future__ import annotations

import threading

from jax import monitoring

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_active = threading.local()  # .counter: the CompileCounter whose function is running on this thread
_listening = False
_lock = threading.Lock()


def _on_event(event: str, secs: float, **kwargs) -> None:
    if event == LOWERING_EVENT:
        counter = getattr(_active, "counter", None)
        if counter is not None:
            with _lock:  # warm-up lowers steps on several threads at once
                counter.count += 1


def _listen() -> None:
    global _listening
    with _lock:
        if not _listening:
            monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True


class CompileCounter:
    """Executables built by the functions wrapped with ``counted``."""

    def __init__(self):
        _listen()
        self.count = 0

    def counted(self, fn) -> "_Counted":
        return _Counted(fn, self)


class _Counted:
    """A jitted function whose calls count their lowerings into a ``CompileCounter``; every
    other attribute (``lower``, ``_cache_size``, ...) is the jitted function's own."""

    def __init__(self, fn, counter: CompileCounter):
        self._fn, self._counter = fn, counter

    def __call__(self, *args, **kwargs):
        return self._counting(self._fn, *args, **kwargs)

    def lower(self, *args, **kwargs):
        """``jax.jit``'s ``lower``, counted: the executable compiled from it is the one a call
        with the same arguments runs (jit shares it), so that call then counts nothing."""
        return self._counting(self._fn.lower, *args, **kwargs)

    def _counting(self, fn, *args, **kwargs):
        outer = getattr(_active, "counter", None)
        _active.counter = self._counter
        try:
            return fn(*args, **kwargs)
        finally:
            _active.counter = outer

    def __getattr__(self, name):
        return getattr(self._fn, name)
