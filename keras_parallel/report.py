"""`describe()`: the sharding plan as a text table."""

import os

from keras_parallel import cluster_environments
from keras_parallel.keras_seam.model_state import STATE_ATTRIBUTE
from keras_parallel.plan import sharding


def describe(model, distribution=None):
    """The sharding plan of a model, as a text table.

    Lists the mesh, every variable (model, optimizer, metrics) with its path,
    shape, dtype, layout axes and bytes per device, and every constrained
    layer output.

    Args:
        model: a built `keras.Model`: a `DistributedModel` compiled with a
            distribution, or any model together with `distribution`.
        distribution: the `keras.distribution.Distribution` to plan for.
            Defaults to the one the model was compiled with.

    Returns:
        The table, a string.

    Raises:
        ValueError: there is no distribution to describe, or the model is not
            built yet.

    Example:

    >>> model.compile(optimizer="sgd", loss="mse",
    ...               distribution=keras_parallel.DataParallel())
    >>> print(keras_parallel.describe(model))
    """
    from keras_parallel.backends import resolve_plan_for
    from keras_parallel.plan.sharding_plan import check_distribution

    # A DistributedModel holds its binding; a ShardingCallback leaves its
    # own on the model it ran.
    state = vars(model).get(STATE_ATTRIBUTE)
    binding = state and (state.binding or state.callback_binding)
    if distribution is None and binding is None:
        raise ValueError(
            f"Model {model.name!r} has no distribution to describe. Received: "
            "distribution=None; pass one, e.g. describe(model, "
            "keras_parallel.DataParallel()), or compile the DistributedModel "
            "with `distribution=`."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its variables are not known "
            "yet. Build it first: call it on a batch, `model.build(shape)`, or "
            "describe it after `fit` started."
        )
    if distribution is None and binding.unchosen():
        return (
            f"{binding.auto!r}: the distribution of model {model.name!r} is "
            "chosen at its first fit (or evaluate, train_on_batch), for the "
            "batch it trains on; describe it after that."
        )
    if distribution is None:
        plan = binding.plan if binding.plan is not None else binding.resolve(model)
        table = format_plan(plan, model.name, binding.executor)
        if binding.choice is not None:
            table = binding.choice.table() + "\n\n" + table
        return table
    else:
        from keras_parallel.backends import executor_class

        check_distribution(distribution)
        executor = executor_class()(distribution)
        plan = resolve_plan_for(distribution, model, executor)
    return format_plan(plan, model.name, executor)


def format_bytes(n):
    """`n` bytes as a short string: `"512 B"`, `"1.5 MiB"`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _count(n, noun):
    """`1 device`, `8 devices`: a count and its noun, singular or plural."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def backend_note(backend):
    """Where the backend came from, when the user did not choose it.

    Returns:
        A sentence when `KERAS_BACKEND` is not set, else `None`.
    """
    from keras_parallel import keras_config

    if os.environ.get("KERAS_BACKEND"):
        return None
    _, source = keras_config.configured_backend()
    return (
        f"KERAS_BACKEND is not set, so Keras runs {backend!r} (from {source}); "
        "set KERAS_BACKEND=jax, torch or tensorflow before Python starts to "
        "choose."
    )


def one_device_hint(plan, executor):
    """What to do when a distribution runs on one device only, or `None`
    when the applied `plan` spans several devices."""
    if plan.num_devices != 1:
        return None
    name = type(executor.distribution).__name__
    available = len(executor.list_devices())
    if available > 1:
        how = (
            f"{executor.backend} sees {available} devices: give the "
            "distribution's mesh more of them (keras_parallel.DataParallel() "
            "spans them all)"
        )
    else:
        how = executor.more_devices_hint()
    message = (
        f"keras_parallel: {name} runs on one device ({plan.devices[0]}), so "
        f"no batch is split. To use more, {how}."
    )
    note = backend_note(executor.backend)
    return message if note is None else f"{message} {note}"


def _axes(axes):
    return "(" + ", ".join("-" if a is None else a for a in axes) + ")"


def _cluster_line(num_processes):
    if num_processes == 1:
        return []
    return [f"Cluster: {cluster_environments.describe_joined()}"]


def format_plan(plan, model_name="model", executor=None):
    """Formats a `ShardingPlan` as the table `describe` returns.

    Args:
        executor: the `Executor` running it, for the backend and the
            processes; `None` for the running backend in one process.
    """
    if executor is None:
        import keras

        backend, num_processes, owners = keras.backend.backend(), 1, None
    else:
        backend, num_processes = executor.backend, executor.num_processes
        owners = executor.device_processes() if num_processes > 1 else None
    mesh = ", ".join(
        f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape, strict=True)
    )
    devices = _count(plan.num_devices, "device")
    if plan.data_parallel_size > 1:
        batch = f"split {plan.data_parallel_size} ways along {plan.batch_axis!r}"
    else:
        batch = f"not split (axis {plan.batch_axis!r} has 1 device)"
    lines = [
        f"Sharding plan of {model_name!r}",
        f"Backend: {backend}, {devices} in {_count(num_processes, 'process')}",
        *_cluster_line(num_processes),
        f"Mesh: {mesh} ({devices}: {', '.join(plan.devices)})",
        f"Batch: {batch}",
    ]
    shard = sharding.describe_shard(plan.shard)
    if shard is not None and plan.data_parallel_size > 1:
        lines.append(shard)
    if owners is not None:
        held = {}
        for device, process in zip(plan.devices, owners, strict=True):
            held.setdefault(process, []).append(device)
        lines += [f"Process {p}: {', '.join(d)}" for p, d in sorted(held.items())]
    lines.append("")
    header = ("Variable", "Kind", "Shape", "Dtype", "Layout", "Bytes/device", "From")
    rows = [
        (
            v.path,
            v.kind,
            str(v.shape),
            v.dtype,
            _axes(v.axes),
            format_bytes(v.bytes_per_device),
            v.key,
        )
        for v in plan.variables
    ]
    if any(v.logical is not None for v in plan.variables):
        header = header[:4] + ("Logical axes",) + header[4:]
        rows = [
            r[:4] + (_axes(v.logical) if v.logical else "",) + r[4:]
            for r, v in zip(rows, plan.variables, strict=True)
        ]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        )
    lines.append("")
    if plan.outputs:
        lines.append("Output constraints:")
        for o in plan.outputs:
            lines.append(f"  {o.path}  {_axes(o.axes)}  (key {o.key!r})")
    else:
        lines.append("Output constraints: none")
    lines.append(
        "Model + optimizer variables per device: "
        f"{format_bytes(plan.bytes_per_device())} of {format_bytes(plan.bytes_total())} "
        "in all"
    )
    return "\n".join(lines)
