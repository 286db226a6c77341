"""SIGTERM / SIGINT during a batch job: stop admitting, give in-flight requests a grace
period, and never stop in the middle of writing a result line."""

from __future__ import annotations

import os
import signal
import threading

GRACE_PERIOD = 20.0  # seconds in-flight requests get after SIGTERM (preemption notices give ~30)


class _Interrupted(Exception):
    pass


class _StopSignals:
    """SIGTERM and SIGINT: the first stops admitting work and gives in-flight requests
    ``grace`` seconds; the second, or the deadline (SIGALRM), stops at once, though never inside
    ``writing()``: the exception waits for the write to finish."""

    def __init__(self, grace: float):
        self.grace = grace
        self.signum: int | None = None
        self.hard = False
        self._writing = 0
        self._deferred = False
        self._armed = False
        self._saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
                self._saved[s] = signal.signal(s, self._on_signal)
            self._armed = True
        return self

    def __exit__(self, *exc):
        self._armed = False
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, h in self._saved.items():
                signal.signal(s, h)
            self._saved = {}

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    def _soft_stop(self, signum: int, where: str, hint: str) -> bool:
        """The first stop: admit no more requests and give those in flight the grace period,
        counted from now (SIGALRM then stops hard). False when there is no grace period."""
        self.signum = signum
        # os.write, not print: the handler may run in the middle of a print
        os.write(2, f"\njaxinfer: {signal.Signals(signum).name}{where}: admitting no more requests; finishing "
                    f"those in flight (up to {self.grace:g} s{hint})\n".encode())
        if self.grace <= 0:
            return False
        if self._saved:  # the handlers are installed, SIGALRM's among them
            signal.setitimer(signal.ITIMER_REAL, self.grace)
        return True

    def _on_signal(self, signum, frame):
        if signum != signal.SIGALRM and self.signum is None:
            if self._soft_stop(signum, "", "; signal again to stop now"):
                return
        self.hard = True
        if not self._armed:
            return
        if self._writing:
            self._deferred = True
        else:
            raise _Interrupted

    def adopt(self, signum: int) -> None:
        """Stop as if ``signum`` had come here too: another process of an SPMD job got it, and
        all must stop admitting at the same request. In-flight requests get the grace period,
        counted from now."""
        if self.signum is None and not self._soft_stop(signum, " on another process", ""):
            self.hard = True

    def check(self) -> None:
        """Raise if a hard stop is due (for stops a handler could not raise, e.g. in a __del__)."""
        if self.hard and self._armed and not self._writing:
            raise _Interrupted

    def writing(self):
        return _Writing(self)

    def disarm(self) -> None:
        """From here on signals are only noted: the run is closing its files."""
        self._armed = False
        if self._saved:
            signal.setitimer(signal.ITIMER_REAL, 0)


class _Writing:
    def __init__(self, s: _StopSignals):
        self.s = s

    def __enter__(self):
        self.s._writing += 1

    def __exit__(self, *exc):
        self.s._writing -= 1
        if self.s._deferred and not self.s._writing and self.s._armed and exc[0] is None:
            self.s._deferred = False
            raise _Interrupted
