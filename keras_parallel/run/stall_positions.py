"""A stall read from every process's position, and its report.

A position is what one process published to the run's store
(`run/stall_watch.py`): JSON of a bounded length, decoded as data. From every
process's position, `stalled_processes` says which stalled; `stall_report`
is the text the stalled process prints. No Keras here.
"""

import json
import os
import sys
import threading
import traceback

from keras_parallel.run.stall_settings import STALL_TIMEOUT_VARIABLE, STALLED_EXIT_CODE

#: A published record longer than this is refused (it comes from another
#: process over the network: data, decoded as JSON, bounded).
MAX_RECORD_CHARS = 2048
#: `waiting_for(EVERY_PROCESS)`: in a collective of every process.
EVERY_PROCESS = -1
#: Frames of a waiting process's main thread shown in the report.
WAITING_FRAMES = 4


def describe_position(record):
    """`"after training batch 3 of epoch 2 ended"`, from a published record."""
    event = record.get("event") or ""
    epoch, batch = record.get("epoch"), record.get("batch")
    if not event:
        return "before its first batch"
    kind = event.split("_")[1]  # epoch, train, test, predict
    moment = "began" if event.endswith("begin") else "ended"
    if kind == "epoch":
        return f"after epoch {epoch} {moment}"
    name = {"train": "training", "test": "validation", "predict": "prediction"}[kind]
    where = f"{name} batch {batch}" + (
        f" of epoch {epoch}" if epoch is not None else ""
    )
    return f"after {where} {moment}"


def decode_record(text):
    """A published position, or None for one that is not a record.

    What another process wrote is data: JSON of a bounded length, a dict of
    known keys with int and str values; anything else is refused.
    """
    if not isinstance(text, str) or len(text) > MAX_RECORD_CHARS:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("moves"), int):
        return None
    kinds = {
        "moves": int,
        "epoch": int,
        "batch": int,
        "event": str,
        "host": str,
        "pid": int,
        "waiting": str,
        "waits_for": int,
        "waited": int,
    }
    clean = {}
    for key, kind in kinds.items():
        value = record.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            clean[key] = value
    return clean


def thread_stacks():
    """Every thread's Python stack of this process, as text."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f'Thread "{names.get(ident, ident)}":')
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(lines)


def main_thread_waits_in():
    """The innermost frames of the main thread: where it waits."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    summary = traceback.extract_stack(frame)[-WAITING_FRAMES:]
    return " <- ".join(
        f"{item.name} ({os.path.basename(item.filename)}:{item.lineno})"
        for item in reversed(summary)
    )


def stalled_processes(positions):
    """The ranks that stalled, from every process's record, by rank.

    A process is behind when another has moved further through Keras's loop
    (finished a step it has not) and has waited for the timeout since
    (`waited`). Where none is, the processes that others have waited for at
    the same step for the timeout, which wait for no one themselves, are:
    the others are in the step's collective, or in the exchange of a
    divided batch (`EVERY_PROCESS`), or wait for one process's part of a
    batch, while these are not (making their batch, drawing their data).
    A wait shorter than the timeout names no one: on busy cores one
    process's first compile may end long before another's.
    """
    behind = sorted(
        rank
        for rank, p in positions.items()
        if any(q["moves"] > p["moves"] and q.get("waited") for q in positions.values())
    )
    if behind:
        return behind
    waiting = {
        rank: p["waits_for"]
        for rank, p in positions.items()
        if p.get("waits_for") is not None and p.get("waited")
    }
    free = {rank for rank, p in positions.items() if p.get("waits_for") is None}
    stalled = set()
    for target in waiting.values():
        if target == EVERY_PROCESS:
            stalled |= free
        elif target in free:
            stalled.add(target)
    return sorted(stalled)


def stall_report(stalled, positions, waiting, timeout, seconds, stacks):
    """The report's text.

    Args:
        stalled: the stalled process's rank.
        positions: every process's decoded record, by rank.
        waiting: the waiting processes' records with `waiting` (where their
            main thread is), by rank.
        timeout: the stall timeout.
        seconds: how long the stalled process has not moved, if known.
        stacks: its every thread's stack, or None (not readable).
    """
    record = positions[stalled]
    how_long = f"{seconds:.0f} s" if seconds is not None else f"over {timeout:g} s"
    lines = [
        f"keras_parallel: process {stalled} (host {record.get('host', '?')}, "
        f"pid {record.get('pid', '?')}) stalled {describe_position(record)}: "
        f"no step for {how_long} while the other processes finished it and wait "
        f"(stall timeout {timeout:g} s, {STALL_TIMEOUT_VARIABLE}). Every process "
        f"ends with exit code {STALLED_EXIT_CODE}; the last backup stays: run "
        "the same command to resume."
    ]
    if stacks is not None:
        lines.append(f"Process {stalled}'s stack, every thread:")
        lines.append(stacks)
    else:
        lines.append(
            f"Process {stalled}'s stack could not be read: its watch did not "
            "run (a native call holding Python's lock?)."
        )
    lines.append("The other processes:")
    for rank in sorted(positions):
        if rank == stalled:
            continue
        other = waiting.get(rank, positions[rank])
        where = other.get("waiting")
        lines.append(
            f"  process {rank} (host {other.get('host', '?')}, pid "
            f"{other.get('pid', '?')}): {describe_position(other)}"
            + (f"; waits in {where}" if where else "")
        )
    return "\n".join(lines)
