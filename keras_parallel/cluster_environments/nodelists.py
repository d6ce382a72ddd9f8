"""SLURM's compressed host lists (`node[01-03,07]`) and task counts (`2(x3),1`)."""

import re

from keras_parallel.cluster_environments.base import environment_error


def _split_top_level(text, variable):
    """`text` split at commas and spaces outside brackets."""
    parts, current, depth = [], "", 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                break
        if depth == 0 and (char == "," or char.isspace()):
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise environment_error(
            f"{variable} has unbalanced brackets",
            f"{variable}={text!r}",
            "give a SLURM node list such as 'node[01-03,07],other'",
        )
    parts.append(current)
    return [p for p in parts if p]


def _expand_part(part, text, variable):
    match = re.search(r"\[([^\[\]]*)\]", part)
    if match is None:
        if "[" in part or "]" in part:
            raise environment_error(
                f"{variable} has a malformed node range",
                f"{variable}={text!r}",
                "give a SLURM node list such as 'node[01-03,07],other'",
            )
        return [part]
    prefix, rest = part[: match.start()], part[match.end() :]
    tails = _expand_part(rest, text, variable)
    hosts = []
    for item in match.group(1).split(","):
        low, dash, high = item.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise environment_error(
                f"{variable} has a node range that is not 'first-last' numbers",
                f"{variable}={text!r} (range {item!r})",
                "give a SLURM node list such as 'node[01-03,07],other'",
            )
        for number in range(int(low), int(high) + 1):
            hosts.extend(f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails)
    return hosts


def expand_nodelist(text, variable="SLURM_STEP_NODELIST"):
    """The host names of a SLURM node list, in its order.

    Args:
        text: e.g. `"node[01-03,07],other"` (ranges keep their zero padding;
            several ranges in one name multiply, as in SLURM).
        variable: the variable it came from, for errors.

    Returns:
        e.g. `["node01", "node02", "node03", "node07", "other"]`.

    Raises:
        ClusterEnvironmentError: `text` is empty or not a node list.
    """
    hosts = []
    for part in _split_top_level(text, variable):
        hosts.extend(_expand_part(part, text, variable))
    if not hosts:
        raise environment_error(
            f"{variable} names no node",
            f"{variable}={text!r}",
            "start the processes with srun, which sets it",
        )
    return hosts


def expand_tasks_per_node(text, variable="SLURM_STEP_TASKS_PER_NODE"):
    """SLURM's tasks per node, one number per node: `"2(x3),1"` → `[2, 2, 2, 1]`.

    Raises:
        ClusterEnvironmentError: `text` is not in SLURM's form.
    """
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise environment_error(
                f"{variable} is not SLURM's tasks-per-node list",
                f"{variable}={text!r}",
                "give it as SLURM does, e.g. '2(x3),1'",
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
