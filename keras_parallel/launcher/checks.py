"""Refusing, before it starts, a launch that would fail in every process.

Shared by every backend, so a bad count or a missing script reads the same.
"""

import os


def check_positive(option, value):
    """Refuses a count below 1, naming the option."""
    if value < 1:
        raise ValueError(
            f"{option} must be a positive number of processes. Received: "
            f"{option} {value}; pass e.g. {option} 2."
        )


def check_script(script, argv, is_path=True):
    """Refuses a missing script (a path that does not exist)."""
    if script is None:
        raise ValueError(
            "no script to run. Received: "
            f"{' '.join(argv) or '(nothing)'}; write "
            "keras-parallel launch --nproc N train.py [args]."
        )
    if is_path and not os.path.isfile(script):
        raise ValueError(
            f"the script {script!r} does not exist. Received: {script!r} "
            f"(from {os.getcwd()}); pass the path of your training script."
        )
