"""SIGTERM and Ctrl-C (SIGINT) in `megajax train`: a scheduler's preemption notice or a user's stop.

Between steps a signal is recorded and the loop saves a checkpoint at the next step and stops
(`should_stop(step)`; with several processes JAX's preemption service relays SIGTERM to every process
and they stop together at the same step). Outside the steps there is nothing to save, and a phase may
be long: tokenising chat data, restoring checkpoint.load, compiling, the exact-match score before the
first step, the end-of-training sample after the last one. There a signal stops the run at once:

    with stop.interruptible("during start-up"):
        ...            # a signal raises Interrupted here (the with-block's callers clean up and report)

The handler's exception is lost where Python ignores exceptions (a garbage-collection callback or a
destructor running when the signal arrived; not printed then); the watcher thread sends the signal again
every REFIRE_SECONDS while the phase runs (those copies are not a user's second signal).
A phase that does not return to Python (XLA compiling a large program) cannot be interrupted by a
Python exception; a watcher thread, woken by the signal itself (signal.set_wakeup_fd), ends the process
if the phase has not stopped GRACE_SECONDS after the signal, and at once on a second signal, with one
line saying so (the run directory's lock is released first: `at_exit` callbacks).

In a multi-process run SIGTERM belongs to JAX's preemption service (the processes must agree on a
step, and the scheduler may signal only one of them; SIGINT is turned into a SIGTERM to this process).
The service publishes the notice to every process: in a phase outside the steps a watcher thread of
each process sees it within half a second, says so, leaves the job (every process passes the shutdown
barrier together, so none is aborted for a peer that left) and ends the process (exit 0). The start-up
ends with a barrier, so the processes enter the steps together and a notice is handled by all of
them in the same way: the steps' checkpoint at one agreed step, or this.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

import jax

from megajax.distributed import barrier, leave_job, preemption_noticed, preemption_sync_point

GRACE_SECONDS = 3.0  # a phase that has not stopped this long after the signal: the process ends
NOTICE_POLL_SECONDS = 0.5  # several processes: how often the watcher asks whether a notice came
REFIRE_SECONDS = 0.5  # one process: how often the watcher sends the signal again while the phase runs on


class Interrupted(BaseException):
    """A stop signal during an interruptible phase (a BaseException, like KeyboardInterrupt: nothing on the
    way out catches it as an error)."""

    def __init__(self, signum: int, phase: str):
        super().__init__(signum, phase)
        self.name, self.phase = signal.Signals(signum).name, phase


def _quiet_about_interrupted(hook):
    """sys.unraisablehook for an interruptible phase: an Interrupted that Python ignored (raised while a
    garbage-collection callback or destructor ran) is not printed, since the watcher sends the signal
    again; anything else goes to `hook`."""
    def quiet(unraisable):
        if not isinstance(unraisable.exc_value, Interrupted):
            hook(unraisable)
    return quiet


def exit_status(name: str | None) -> int:
    """`megajax train`'s exit status after a stop: 130 after Ctrl-C (the shell's convention), 0 otherwise
    (SIGTERM: the run stopped as a scheduler asks, saving what there was to save)."""
    return 130 if name == "SIGINT" else 0


class StopSignals:
    """Records SIGTERM/SIGINT so the loop can checkpoint and stop; raises Interrupted in an interruptible
    phase (one process only). Installed before start-up."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, say: Callable[[str], None] = print):
        self.received: int | None = None
        self.multiprocess = jax.process_count() > 1
        self.phase: str | None = None  # the interruptible phase running now
        self.at_exit: list[Callable[[], None]] = []  # before the process ends at once (watcher)
        self.say = say
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._lock = threading.Lock()
        self._done = False
        self._started = False  # several processes: past the start-up barrier
        self._refired = 0  # signals the watcher sent again whose wake-up bytes it has not read yet

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT,) if self.multiprocess else self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            if not self.multiprocess:
                self._start_watcher()
        if self.multiprocess:
            threading.Thread(target=self._watch_notices, name="megajax-stop-watcher", daemon=True).start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._done = True
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.write(self._wakeup[1], b"\0")  # wakes the watcher, which closes its end
            os.close(self._wakeup[1])
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    # -- the main thread ---------------------------------------------------------------------------

    def _handle(self, signum, frame):
        self.received = self.received or signum
        if self.multiprocess and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.phase is not None:  # again for the watcher's copies: the first raise may have been ignored
            raise Interrupted(self.received, self.phase)

    @contextlib.contextmanager
    def interruptible(self, phase: str):
        """A phase with nothing to save (`phase` as a message says it: "during start-up"): a signal in it,
        or already received, raises Interrupted (one process; with several, the notice watcher ends every
        process)."""
        if self.multiprocess and self._started:  # past the start-up the steps speak for every process
            yield
            return
        if self.received is not None and not self.multiprocess:
            raise Interrupted(self.received, phase)
        self.phase = phase
        previous_hook = sys.unraisablehook
        sys.unraisablehook = _quiet_about_interrupted(previous_hook)
        try:
            yield
        finally:
            self.phase = None
            sys.unraisablehook = previous_hook

    def started(self) -> None:
        """The end of the start-up. With several processes: a barrier, so all enter the steps together; a
        notice that came before it ends every process here, one that comes after is the steps' (a checkpoint
        at an agreed step)."""
        if not self.multiprocess:
            return
        barrier("megajax-start-up-done")
        with self._lock:
            phase, self.phase, self._started = self.phase, None, True
        if preemption_noticed():
            self._leave(phase or "during start-up")

    def should_stop(self, step: int) -> bool:
        """Called once per step by every process."""
        if not self.multiprocess:
            return self.received is not None
        if preemption_sync_point(step):
            self.received = self.received or signal.SIGTERM
            return True
        return False

    # -- the watcher thread ------------------------------------------------------------------------

    def _start_watcher(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read)
            os.close(write)
            return
        self._wakeup = (read, write)
        threading.Thread(target=self._watch, args=(read,), name="megajax-stop-watcher", daemon=True).start()

    def _watch(self, fd: int) -> None:
        """Ends the process when an interrupted phase does not stop within GRACE_SECONDS, or on a second
        signal during one; until then sends the signal again every REFIRE_SECONDS (its first exception
        may have been ignored)."""
        first: tuple[float, int] | None = None  # (when, signal) of the signal that interrupted a phase
        refire = 0.0  # when to send it again
        try:
            while True:
                wait = None if first is None else max(min(first[0] + GRACE_SECONDS, refire) - time.monotonic(), 0.0)
                if select.select([fd], [], [], wait)[0]:
                    got = [s for s in os.read(fd, 64) if s in self.SIGNALS]
                else:
                    got = []
                with self._lock:
                    if self._done:
                        return
                    phase = self.phase
                    mine = min(self._refired, len(got))  # the copies this thread sent are no second signal
                    self._refired -= mine
                    got = got[mine:]
                if phase is None:
                    first = None
                    continue
                if got and first is None:
                    first = (time.monotonic(), got.pop(0))
                    refire = first[0] + REFIRE_SECONDS
                if got:
                    self._end_now(got[0], phase, "a second signal")
                elif first is not None and time.monotonic() >= first[0] + GRACE_SECONDS:
                    self._end_now(first[1], phase, f"it had not stopped {GRACE_SECONDS:g} s later: the phase runs "
                                                   f"outside Python, e.g. XLA compiling")
                elif first is not None and time.monotonic() >= refire:
                    with self._lock:
                        self._refired += 1
                    os.kill(os.getpid(), first[1])
                    refire = time.monotonic() + REFIRE_SECONDS
        finally:
            os.close(fd)

    def _watch_notices(self) -> None:
        """Several processes: in a phase outside the steps, a preemption notice from any process ends this
        one, as it ends every other."""
        while True:
            time.sleep(NOTICE_POLL_SECONDS)
            with self._lock:
                if self._done:
                    return
                phase = self.phase
            if phase is None or not preemption_noticed():
                continue
            with self._lock:
                if self._done or self.phase is None:
                    continue
                self._leave(phase)

    def _leave(self, phase: str) -> None:
        """Several processes, a notice outside the steps: says so, leaves the job and ends this process."""
        for callback in self.at_exit:
            with contextlib.suppress(Exception):
                callback()
        with contextlib.suppress(Exception):
            self.say(f"megajax: SIGTERM received by a process of the job {phase}: every process stops; "
                     f"nothing to save.")
            sys.stdout.flush()
        threading.Timer(30.0, os._exit, (0,)).start()  # a peer that never leaves: do not wait for it
        with contextlib.suppress(Exception):
            leave_job()
        os._exit(0)

    def _end_now(self, signum: int, phase: str, why: str) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            if self._done:
                return
            for callback in self.at_exit:
                with contextlib.suppress(Exception):
                    callback()
            with contextlib.suppress(Exception):
                self.say(f"megajax: {name} received {phase}: stopping at once ({why}); nothing to save.")
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(exit_status(name))
