"""One thread per entry point that talks to the run's store once a second.

The preemption's stop agreement (a notice to look for) and the stall watch
(this process's position to publish) share it, so that the store, one
coordinator for every process of the run, serves about one request a second
per process whatever the step rate (`benchmarks/control_plane.py`).
"""

import threading

#: Seconds between two ticks.
TICK_S = 1.0


class Heartbeat:
    """Calls each registered `tick()` once per `interval`, in one daemon thread.

    A tick that returns False is not called again; one that raises is not
    called again either (the store is gone: the run is ending).

    Args:
        interval: seconds between two ticks.
        name: the thread's name (shown in a stall report's stacks).

    Example:

    ```python
    heartbeat = Heartbeat()
    heartbeat.add(lambda: print("tick") or True)
    heartbeat.start()
    heartbeat.close()
    ```
    """

    def __init__(self, interval=TICK_S, name="keras_parallel-heartbeat"):
        self.interval = interval
        self.name = name
        self._ticks = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = None

    def add(self, tick):
        """Registers `tick`, called from the next tick on."""
        with self._lock:
            self._ticks.append(tick)

    def start(self):
        """Starts the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=self.name, daemon=True
            )
            self._thread.start()

    def close(self):
        """Stops the thread and waits for the tick under way."""
        self._closed.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval * 10)

    def _run(self):
        while not self._closed.wait(self.interval):
            with self._lock:
                ticks = list(self._ticks)
            for tick in ticks:
                if self._closed.is_set():
                    return
                try:
                    again = tick()
                except Exception:
                    again = False
                if again is False:
                    with self._lock:
                        self._ticks.remove(tick)
