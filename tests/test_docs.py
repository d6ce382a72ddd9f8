"""The documentation's Python examples run as written: a stale one fails here.

Every fenced ```python block of README.md and docs/*.md is a case. Each runs
as a script (`python block.py`: `__name__ == "__main__"`, as a reader's file
would) in a fresh process, in a temporary folder, with a hard timeout, on the
suite's backend (`KERAS_BACKEND`; JAX's 8 simulated devices come through
`XLA_FLAGS`, TensorFlow's logical devices from `keras_parallel.split_cpu`
before the block).

What a block takes for granted (the reader's own model and data) is said in
an HTML comment on the line above its fence, which the rendered page hides:

    <!-- docs-check: prelude regression -->

Directives, separated by `;`:

- `prelude NAME[, NAME]`: run `SNIPPETS[NAME]` first (the reader's model,
  data, files); `then NAME`: run `SNIPPETS[NAME]` after the block.
- `only BACKEND[, BACKEND] (why)`: run on those backends alone.
  A block with neither `only` nor `needs` runs on one backend of the
  matrix, the backends taking such blocks in turn (`backend_of`): what it
  shows is plain Keras and keras_parallel's public API, which the suite's
  own tests check on every backend; its staleness shows on any of them,
  and its process need not start in every env.
- `needs MODULE`: skip where an optional extra is not installed.
- `launch N`: run under `keras-parallel launch --nproc-per-node N`.
- `expect REGEX`: the block's output must match (a number the text promises).
- `skip (why)`: never run.
- `slow (why)`: an accuracy run of minutes, run with the opt-in accuracy
  runs alone (`pytest -m slow`), as the suite's own.

Every skip says why, and a marker this file does not understand fails.

The `keras-parallel` commands of the shell blocks are not run (they train
for minutes, or on several machines); their subcommands and options must be
ones `keras-parallel <subcommand> --help` names.
"""

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
from subprocesses import checkout_env, run_in_session

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# conftest sets the default before this module is imported.
BACKEND = os.environ["KERAS_BACKEND"]
BACKENDS = ("jax", "torch", "tensorflow")
# One block's hard limit. The slowest, docs/torch.md's 30 epochs of the
# convnet (one process, then two), took 12-70 s each on 2 busy cores: they
# are `slow`, run with the accuracy runs (`pytest -m slow`).
TIMEOUT_S = 240

FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-check:(.*)-->\s*$")

# Put before every block of a backend (but under `launch`, which sets up
# each process's devices): what conftest does for the suite's own process.
BASE = {
    "tensorflow": (
        "import keras_parallel\n"
        "keras_parallel.split_cpu(4)  # The suite's logical devices.\n"
    ),
}

# What the blocks take for granted. Small: a few steps each.
_DATA = """\
import numpy as np

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 16)).astype("float32")
y = rng.normal(size=(128, 8)).astype("float32")
"""
_NET = """\
import keras
import keras_parallel


class Net(keras_parallel.DistributedModel, keras.Model):
    pass
"""
_D1_D2 = """\
def build_model():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    return Net(inputs, keras.layers.Dense(8, name="d2")(hidden))
"""
SNIPPETS = {
    # `inputs`, `outputs` of a functional model, and its data.
    "regression": _DATA
    + """
import keras

inputs = keras.Input((16,))
outputs = keras.layers.Dense(8)(keras.layers.Dense(32, activation="relu")(inputs))
""",
    # The same for a classifier: labels, `loss`, a train and a test split.
    "classifier": _DATA
    + """
import keras

y = x[:, :4].argmax(axis=1).astype("int32")
x_train, y_train, x_test, y_test = x[:96], y[:96], x[96:], y[96:]
loss = "sparse_categorical_crossentropy"
inputs = keras.Input((16,))
hidden = keras.layers.Dense(32, activation="relu")(inputs)
outputs = keras.layers.Dense(4, activation="softmax")(hidden)
""",
    # A compiled plain Keras model (one you cannot subclass).
    "plain_model": _DATA
    + """
import keras
import keras_parallel

inputs = keras.Input((16,))
model = keras.Model(inputs, keras.layers.Dense(8)(inputs))
model.compile(optimizer="adam", loss="mse")
""",
    # A compiled DistributedModel with DataParallel.
    "distributed_model": _DATA
    + _NET
    + """
inputs = keras.Input((16,))
model = Net(inputs, keras.layers.Dense(8)(inputs))
model.compile(optimizer="adam", loss="mse",
              distribution=keras_parallel.DataParallel())
""",
    # A built `Net` with layers `d1` and `d2`, for the LayoutMap examples.
    "d1_d2": _DATA + _NET + _D1_D2 + "\nmodel = build_model()\n",
    # Train what the block compiled.
    "fit": "model.fit(x, y, batch_size=64, epochs=1, verbose=0)\n",
    # `model.keras` and `pretrained.keras` (a plain model), a distribution.
    "saved": _DATA
    + """
import keras
import keras_parallel

inputs = keras.Input((16,))
saved = keras.Model(inputs, keras.layers.Dense(8)(inputs))
saved.compile(optimizer="adam", loss="mse")
saved.save("model.keras")
saved.save("pretrained.keras")
distribution = keras_parallel.DataParallel()
""",
    # A ModelParallel `distribution`, `build_model()`, a `model`, and data
    # for 50 steps an epoch (OrbaxCheckpoint(save_freq=500) saves at 500).
    "orbax": _DATA.replace("128", "1600")
    + _NET
    + _D1_D2
    + """
mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"])
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["d1/kernel"] = (None, "model")
distribution = keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="data")
model = build_model()
""",
    # An Orbax checkpoint of `model` in `directory` (after `orbax`).
    "checkpointed": """
import os

directory = os.path.abspath("ckpt")
model.compile(optimizer="adam", loss="mse", distribution=distribution)
model.fit(x, y, batch_size=400, epochs=1, verbose=0,
          callbacks=[keras.callbacks.OrbaxCheckpoint(directory)])
""",
}


def backend_of(block, blocks):
    """The one backend a block that names none runs on: in turn, by order.

    Blocks with `only` or `needs` keep their own rule (where a `needs` is
    installed depends on the env, so such a block runs wherever it can).
    """
    generic = [
        b.where
        for b in blocks
        if not ({"only", "needs", "skip", "slow"} & set(b.directives))
    ]
    if block.where not in generic:
        return None
    return BACKENDS[generic.index(block.where) % len(BACKENDS)]


@dataclasses.dataclass
class Block:
    """One ```python block and its directives."""

    where: str
    code: str
    directives: dict = dataclasses.field(default_factory=dict)
    error: str = ""

    def program(self):
        names = self.directives.get("prelude", []) + ["(block)"]
        names += self.directives.get("then", [])
        parts = [] if "launch" in self.directives else [BASE.get(BACKEND, "")]
        for name in names:
            text = self.code if name == "(block)" else SNIPPETS[name]
            parts.append(f"# --- {self.where if name == '(block)' else name}\n{text}")
        return "\n".join(parts)


def parse_marker(text):
    """The directives of one `docs-check:` comment; ValueError if unclear."""
    directives = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, _, rest = part.partition(" ")
        rest = rest.strip()
        if name in ("skip", "only", "slow"):
            found = re.fullmatch(r"([^()]*?)\s*\((.+)\)", rest)
            if not found or (name != "only") == bool(found.group(1)):
                raise ValueError(f"{part!r}: write `{name} ... (why)`")
            if name == "only":
                backends = [b.strip() for b in found.group(1).split(",")]
                unknown = set(backends) - set(BACKENDS)
                if unknown:
                    raise ValueError(f"{part!r}: unknown backends {sorted(unknown)}")
                directives["only"] = backends
            directives[name + "_reason"] = found.group(2)
            directives.setdefault(name, True)
        elif name in ("prelude", "then"):
            names = [n.strip() for n in rest.split(",")]
            unknown = [n for n in names if n not in SNIPPETS]
            if unknown:
                raise ValueError(f"{part!r}: no snippet {unknown} in SNIPPETS")
            directives[name] = names
        elif name == "needs" and rest:
            directives["needs"] = rest
        elif name == "launch" and rest.isdigit():
            directives["launch"] = int(rest)
        elif name == "expect" and rest:
            re.compile(rest)
            directives["expect"] = rest
        else:
            raise ValueError(f"{part!r}: not a docs-check directive")
    return directives


def fenced(path):
    """`(language, the fence's line number, code, line above)` of each block."""
    lines = path.read_text().splitlines()
    above = ""
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            if lines[i].strip():
                above = lines[i]
            i += 1
            continue
        indent, language = len(fence.group(1)), fence.group(2)
        start = i = i + 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        code = "\n".join(line[indent:] for line in lines[start:i]) + "\n"
        yield language, start, code, above
        above = ""
        i += 1


def collect(documents=DOCUMENTS):
    """Every ```python block of `documents`, in order."""
    blocks = []
    for path in documents:
        for language, start, code, above in fenced(path):
            if language != "python":
                continue
            block = Block(f"{path.relative_to(ROOT)}:{start}", code)
            marker = MARKER.match(above)
            if marker:
                try:
                    block.directives = parse_marker(marker.group(1))
                except (ValueError, re.error) as error:
                    block.error = f"{block.where}: bad docs-check marker: {error}"
            blocks.append(block)
    return blocks


BLOCKS = collect()


def test_blocks_are_found_and_most_run():
    assert len(BLOCKS) >= 10, [b.where for b in BLOCKS]
    skipped = [b for b in BLOCKS if "skip" in b.directives]
    assert len(skipped) * 4 <= len(BLOCKS), [b.where for b in skipped]


def test_markers_are_understood():
    assert [b.error for b in BLOCKS if b.error] == []


def test_every_generic_block_runs_on_one_backend_and_each_backend_takes_some():
    turns = [backend_of(b, BLOCKS) for b in BLOCKS]
    generic = [t for t in turns if t is not None]
    assert generic, "no block names no backend"
    assert set(generic) == set(BACKENDS) or len(generic) < len(BACKENDS), generic


def test_a_bad_marker_is_refused():
    for text in (
        " skip",
        " slow",
        " slow torch (why)",
        " only torch",
        " prelude nothing",
        " frobnicate 3",
    ):
        with pytest.raises(ValueError):
            parse_marker(text)
    assert parse_marker(" skip (needs 16 GPUs)") == {
        "skip": True,
        "skip_reason": "needs 16 GPUs",
    }
    assert parse_marker(" slow (30 epochs)") == {
        "slow": True,
        "slow_reason": "30 epochs",
    }


def _block_params():
    return [
        pytest.param(
            block,
            id=block.where,
            marks=[pytest.mark.slow] if "slow" in block.directives else [],
        )
        for block in BLOCKS
    ]


@pytest.mark.parametrize("block", _block_params())
def test_block_runs_as_written(block, tmp_path):
    if block.error:
        pytest.fail(block.error)
    directives = block.directives
    if "skip" in directives:
        pytest.skip(f"{block.where}: {directives['skip_reason']}")
    if BACKEND not in directives.get("only", BACKENDS):
        only = "/".join(directives["only"])
        pytest.skip(f"{block.where}: {only} only: {directives['only_reason']}")
    turn = backend_of(block, BLOCKS)
    if turn not in (None, BACKEND):
        pytest.skip(f"{block.where}: names no backend; runs in the {turn} env")
    needs = directives.get("needs")
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{block.where}: needs {needs}, not installed")
    program = block.program()
    script = tmp_path / "block.py"
    script.write_text(program)
    command = [sys.executable, str(script)]
    if "launch" in directives:
        command = [sys.executable, "-m", "keras_parallel.cli", "launch"]
        command += ["--backend", BACKEND, "--nproc-per-node", str(directives["launch"])]
        command += [str(script)]
    env = checkout_env(scikit_learn=True, KERAS_BACKEND=BACKEND)
    try:
        result = run_in_session(command, env, TIMEOUT_S, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where} ran over {TIMEOUT_S} s:\n{numbered(program)}")
    assert result.returncode == 0, (
        f"{block.where} fails as written (exit {result.returncode}); what it "
        "takes for granted goes in a docs-check marker (tests/test_docs.py):\n"
        f"{numbered(program)}\n--- stderr (end) ---\n{result.stderr[-4000:]}"
    )
    expect = directives.get("expect")
    if expect:
        assert re.search(expect, result.stdout, re.MULTILINE), (
            f"{block.where}: its output does not match {expect!r}:\n"
            f"{result.stdout[-3000:]}"
        )


def shell_commands():
    """`(where, words, backend)` of each `keras-parallel` command in a shell block."""
    for path in DOCUMENTS:
        for language, start, code, _ in fenced(path):
            if language not in ("", "bash", "sh", "shell", "console"):
                continue
            for line in code.replace("\\\n", " ").splitlines():
                for command in line.split("#")[0].split("&&"):
                    words = command.split()
                    backend = None
                    while words and "=" in words[0]:
                        # `KERAS_BACKEND=torch keras-parallel ...`
                        name, _, value = words.pop(0).partition("=")
                        backend = value if name == "KERAS_BACKEND" else backend
                    if words[:1] != ["keras-parallel"]:
                        continue
                    if "--backend" in words[:-1]:
                        backend = words[words.index("--backend") + 1]
                    yield f"{path.relative_to(ROOT)}:{start}", words[1:], backend


def test_shell_commands_name_real_subcommands_and_options():
    commands = list(shell_commands())
    assert len(commands) >= 5, commands
    helps = {}
    for where, words, backend in commands:
        if backend == "torch" and importlib.util.find_spec("torch") is None:
            continue  # torchrun's options are listed where torch is installed.
        if words[0] not in helps:
            result = subprocess.run(
                [sys.executable, "-m", "keras_parallel.cli", words[0], "--help"],
                capture_output=True,
                text=True,
                timeout=120,
                env=checkout_env(scikit_learn=True, KERAS_BACKEND=BACKEND),
            )
            assert result.returncode == 0, f"{where}: {words}\n{result.stderr}"
            helps[words[0]] = result.stdout
        options = []
        for word in words[1:]:
            if word.endswith(".py"):
                break  # The script's own arguments follow.
            if word.startswith("--"):
                options.append(word.split("=")[0])
        missing = [
            o
            for o in options
            if not re.search(rf"(?<![\w-]){o}(?![\w-])", helps[words[0]])
        ]
        assert missing == [], f"{where}: `keras-parallel {' '.join(words)}`"


def numbered(program):
    return "\n".join(f"{n:4} {line}" for n, line in enumerate(program.split("\n"), 1))
