"""A process's memory as Linux reports it, for the benchmarks."""


def status_kib(field):
    """A field of `/proc/self/status` in KiB (`VmRSS`, `VmHWM`, `VmSize`).

    Args:
        field: the field's name.

    Returns:
        Its value in KiB, or 0 where the field is missing.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    """Resets the peak resident set (`VmHWM`) to the current one (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def timed_steps(model, x, y, batch, steps):
    """One warm-up step, then `steps` timed ones, the peak reset between.

    Each step is its own `fit` of one global batch, on the next rows of
    `x` and `y` (which need `batch * (steps + 1)` rows).

    Returns:
        The seconds of each timed step; read `status_kib("VmHWM")` after it
        for the peak resident set of the timed steps.
    """
    import time

    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)
    reset_peak()
    times = []
    for step in range(1, steps + 1):
        rows = slice(step * batch, (step + 1) * batch)
        start = time.perf_counter()
        model.fit(x[rows], y[rows], batch_size=batch, epochs=1, verbose=0)
        times.append(time.perf_counter() - start)
    return times
