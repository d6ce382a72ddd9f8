"""The package's import layers: each module imports only from below it.

Every `keras_parallel` import is read from the source (those inside
functions too, which a run would hide until they execute), so a module
that reaches up a layer, or two modules that import each other, fail here
before they tangle. The layers are the module map of `docs/design.md`.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_parallel"

#: Lowest first. A module may import its own layer and the layers below.
LAYERS = (
    # What every layer uses: Keras's internals and the seam into Keras, the
    # plan, errors, the messages between processes, helpers.
    (
        "errors",
        "messages",
        "keras_seam",
        "plan",
        "keras_config",
        "cluster_environments",
        "input",
        "tested_versions",
        "run",
        "run.chief",
        "run.chief_writes",
        "run.heartbeat",
        "run.stall_settings",
        "run.stall_positions",
        "run.stall_watch",
    ),
    # One executor per backend, and the contract they share; the join of a
    # cluster's processes, which starts a backend's runtime.
    ("backends", "cluster_environments.join"),
    # What reads and writes files; the distribution helper; the plan's
    # table; Auto's choice.
    ("persistence", "distribution", "report", "auto"),
    # A distribution bound to a model; what is in force around one entry point.
    ("run.binding", "run.run"),
    # The public doors.
    ("model", "callback"),
    # Starting processes.
    ("launcher",),
    # The command line and what only it runs.
    ("cli", "demo", "bug_report", ""),
)
BACKENDS = ("jax", "torch", "tensorflow")


def module_name(path):
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path, known):
    """The package modules `path` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from keras_parallel.x import y`: y is a module of x, or a name
            # in x.
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in submodules if n[len("keras_parallel.") :] in known]
            names = names or [node.module]
        else:
            continue
        for name in names:
            if name == "keras_parallel" or name.startswith("keras_parallel."):
                inner = name[len("keras_parallel.") :] if "." in name else ""
                if inner in known:
                    found.add(inner)
    return found


def graph():
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def layer_of(name):
    # The longest listed prefix decides: `run.binding` has a layer of its
    # own, above `run`'s.
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        for index, layer in enumerate(LAYERS):
            if prefix in layer:
                return index
    raise AssertionError(
        f"module keras_parallel.{name} has no layer. Received: top-level name "
        f"{parts[0]!r}; add it to LAYERS in tests/test_import_layers.py and to "
        "the module map of docs/design.md."
    )


def backend_of(name):
    parts = name.split(".")
    if parts[0] == "backends" and len(parts) > 1 and parts[1] in BACKENDS:
        return parts[1]
    return None


def test_the_graph_is_read_from_the_source():
    edges = graph()
    # Spot checks that the reader sees module-level, function-level and
    # `from package import module` imports.
    assert "run.binding" in edges["model"]
    assert "backends.jax.orbax" in edges["backends.jax.checkpoint_io"]
    assert "launcher.checks" in edges["launcher.local_processes"]
    assert len(edges) > 50


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"keras_parallel.{name} imports keras_parallel.{target}"
        for name, targets in sorted(graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_no_backend_imports_another_backend():
    crossing = [
        f"{name} -> {target}"
        for name, targets in sorted(graph().items())
        for target in sorted(targets)
        if backend_of(name) and backend_of(target) not in (None, backend_of(name))
    ]
    assert crossing == []


def test_no_import_circle():
    edges = graph()
    circles = []
    # Each module's reach; a module that reaches itself is on a circle.
    for start in sorted(edges):
        seen, stack = set(), list(edges[start])
        while stack:
            name = stack.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                stack.extend(edges[name])
    assert circles == []


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("backends.tensorflow.workers", "launcher"),
        ("backends.torch.executor", "launcher"),
        ("persistence.saving", "model"),
        ("model", "backends.jax"),
    ],
)
def test_the_tangles_once_found_stay_gone(module, forbidden):
    targets = graph()[module]
    assert not [t for t in targets if t == forbidden or t.startswith(forbidden + ".")]
