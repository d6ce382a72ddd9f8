"""The private names keras_parallel's source uses of other packages' objects.

Read from the source with `ast`, without importing it (every backend's
modules, whichever backend runs the tests):

- every attribute access `x._name` (and `getattr(x, "_name")`, `setattr`,
  `hasattr`) whose name keras_parallel does not own;
- every import of `keras.src` outside the `keras_compat` modules.

A name is keras_parallel's own where one of its classes defines it: a
method, a class attribute, or a `self._name = ...` in a method of a class
whose bases are all keras_parallel's (or none). A `self._name` in a class
that extends a Keras class (a `BackupAndRestore`, a `Callback`), or in a
function installed on a Keras class, is Keras's unless that class assigns
it itself. Names made with keras_parallel's own prefixes (`_kp_`,
`_keras_parallel`) are its own tags on other objects.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parents[1] / "keras_parallel"
OWN_PREFIXES = ("_kp_", "_keras_parallel")
_ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")
#: The names a method calls its own object by (`this`: in a closure that
#: another object's `self` would shadow).
_SELF = ("self", "cls", "this")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text())


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _classes(modules):
    """`{(module, class name): (base names, names it defines)}`."""
    classes = {}
    for module, tree in modules:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(base).split(".")[-1] for base in node.bases]
            defined = set()
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(
                    item.ctx, ast.Store
                ):
                    if ast.unparse(item.value) in _SELF:
                        defined.add(item.attr)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    defined.add(item.id)
            classes[module, node.name] = (bases, defined)
    return classes


def _class_key(classes, module, name):
    """The key of class `name` as seen from `module`: its own module's
    class of that name first, else any of the package's, else None."""
    if (module, name) in classes:
        return module, name
    return next((key for key in classes if key[1] == name), None)


def _own_classes(classes):
    """The keys of the classes whose bases are all keras_parallel's."""

    def ours(key, seen=()):
        if key is None or key in seen:
            return False
        bases = classes[key][0]
        return all(
            base == "object" or ours(_class_key(classes, key[0], base), (*seen, key))
            for base in bases
        )

    return {key for key in classes if ours(key)}


def _module_level_names(modules):
    """The functions, classes and variables defined at a module's top
    level: `module._name` of one of keras_parallel's own modules."""
    names = set()
    for _, tree in modules:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _defined_in_class(classes, key, attribute, seen=()):
    """Whether class `key` (or a keras_parallel base of it) defines it."""
    if key is None or key in seen:
        return False
    bases, defined = classes[key]
    return attribute in defined or any(
        _defined_in_class(
            classes, _class_key(classes, key[0], base), attribute, (*seen, key)
        )
        for base in bases
    )


def foreign_private_names(modules=None):
    """`{name: [(module, line), ...]}` of the private names used on other
    packages' objects.

    Args:
        modules: `[(module path, ast tree)]`; by default keras_parallel's.
    """
    modules = list(_modules()) if modules is None else modules
    classes = _classes(modules)
    own_classes = _own_classes(classes)
    own = {name for key in own_classes for name in classes[key][1]}
    own |= _module_level_names(modules)
    found = {}

    def add(name, module, line):
        if _is_private(name) and not name.startswith(OWN_PREFIXES):
            found.setdefault(name, []).append((module, line))

    for module, tree in modules:
        for node, enclosing in _walk_with_class(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = ast.unparse(node.value)
                if base in _SELF and enclosing is not None:
                    key = _class_key(classes, module, enclosing)
                    if key in own_classes:
                        # A class of keras_parallel's own (a mixin too):
                        # its object's names are keras_parallel's.
                        if node.attr not in own:
                            add(node.attr, module, node.lineno)
                    elif not _defined_in_class(classes, key, node.attr):
                        add(node.attr, module, node.lineno)
                elif node.attr not in own or base in _SELF:
                    add(node.attr, module, node.lineno)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in _ATTRIBUTE_FUNCTIONS
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value not in own
            ):
                add(node.args[1].value, module, node.lineno)
    return found


def _walk_with_class(tree):
    """Every node, with the name of the class whose method holds it (None
    in module-level functions: a `self` there is an object of another's
    class, as in a function installed on a Keras class)."""
    stack = [(tree, None)]
    while stack:
        node, enclosing = stack.pop()
        yield node, enclosing
        for child in ast.iter_child_nodes(node):
            # A method's nodes have its class; a nested function (a
            # closure) keeps its method's; a nested class starts anew.
            if isinstance(node, ast.ClassDef) and isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef
            ):
                stack.append((child, node.name))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, None))
            else:
                stack.append((child, enclosing))


def keras_src_imports():
    """`[(module, imported)]`: imports of `keras.src` outside the
    `keras_compat` modules."""
    found = []
    for module, tree in _modules():
        if module.endswith("keras_compat.py"):
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [(module, n) for n in names if n.startswith("keras.src")]
    return found


def listed_names():
    """Every private name the registries list: the string constants of the
    `keras_compat` modules (their `REPLACED` targets, `OBJECT_ATTRIBUTES`,
    `internal(...)` names, `UNCHECKED_ATTRIBUTES`, `OTHER_PRIVATE_NAMES`)
    and of tf.data's tables (`input/tf_data_rows.py`)."""
    names = set()
    paths = [*PACKAGE.rglob("keras_compat.py"), PACKAGE / "input" / "tf_data_rows.py"]
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for part in node.value.replace(",", " ").replace(".", " ").split():
                    if _is_private(part):
                        names.add(part)
    return names
