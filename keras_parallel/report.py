"""`describe()`: the sharding plan as a text table."""


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
    from keras_parallel.plan import check_distribution

    # A DistributedModel holds its binding; a ShardingCallback leaves its
    # own on the model it ran.
    binding = getattr(model, "_kp_binding", None) or getattr(
        model, "_kp_callback_binding", None
    )
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
    if distribution is None:
        plan = binding.plan if binding.plan is not None else binding.resolve(model)
        executor = binding.executor
    else:
        from keras_parallel.backends import executor_class

        check_distribution(distribution)
        executor = executor_class()(distribution)
        plan = resolve_plan_for(distribution, model, executor)
    return format_plan(plan, model.name, executor)


def _bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _axes(axes):
    return "(" + ", ".join("-" if a is None else a for a in axes) + ")"


def format_plan(plan, model_name="model", executor=None):
    """Formats a `ShardingPlan` as the table `describe` returns.

    Args:
        plan: a `ShardingPlan`.
        model_name: the name shown in the heading.
        executor: the `Executor` running it, for the backend and the
            processes; `None` for the running backend in one process.

    Returns:
        A string.
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
    processes = "1 process" if num_processes == 1 else f"{num_processes} processes"
    lines = [
        f"Sharding plan of {model_name!r}",
        f"Backend: {backend}, {plan.num_devices} devices in {processes}",
        f"Mesh: {mesh} ({plan.num_devices} devices: {', '.join(plan.devices)})",
        f"Batch: split {plan.data_parallel_size} ways along {plan.batch_axis!r}",
    ]
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
            _bytes(v.bytes_per_device),
            v.key,
        )
        for v in plan.variables
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
        f"{_bytes(plan.bytes_per_device())} of {_bytes(plan.bytes_total())} "
        "in all"
    )
    return "\n".join(lines)
