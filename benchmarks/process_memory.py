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
