"""Moving a model from `keras.layers.MultiHeadAttention` to `keras_mha.MultiHeadAttention`.

- `swapped()`: a context manager; while it is active, constructing the built-in layer
  constructs ours with the same arguments, wherever the code that constructs it lives
  (a functional model's config, a user layer's `__init__`, a `.keras` file).
- `swap(model)`: a new model in which every built-in attention layer, at the top level
  or nested in the user's layers at any depth, is ours with the same configuration and
  the same weights; the original is untouched. The copy is Keras's own round trip (a
  temporary `.keras` file, loaded under `swapped()`), so variables, compile settings and
  optimizer state come across as they do through `model.save` / `load_model`.
- `save_swapped(model, filepath)`: a `.keras` file that loads swapped with only
  `import keras_mha` (also with `safe_mode=True`). A plain `model.save` of a swapped
  model keeps the swap only for attention layers that appear in the model's config:
  a user layer that creates the built-in in its `__init__` creates it again on load.
- `swap_report(original, swapped)`: one row per attention layer: path, what it was,
  what it is, and why it was left alone where it was.

Subclasses of the built-in (keras-hub's `CachedMultiHeadAttention`, Whisper's,
Moonshine's, XLNet's) are rebuilt on our class, which provides the built-in's protected
API with its meaning (`keras_mha.builtin_hooks`). One that overrides a protected method
our layer would not call as the built-in does (not in `PROTECTED_OVERRIDES`), or touches
a protected name ours lacks, is left on the built-in and reported, with those names.
"""

import contextlib
import dis
import functools
import json
import os
import re
import shutil
import tempfile
import threading
import types
import warnings
import zipfile

import keras

from keras_mha import hub
from keras_mha import layer as layer_lib

BUILTIN = keras.layers.MultiHeadAttention

# Protected methods of the built-in that a subclass may override: our layer calls them
# where the built-in does, with the built-in's arguments (`keras_mha.builtin_hooks`;
# tests/test_subclass.py).
PROTECTED_OVERRIDES = frozenset(
    {
        "_build_attention",
        "_compute_attention",
        "_compute_attention_mask",
        "_compute_causal_mask",
        "_compute_sliding_window_mask",
        "_get_common_kwargs_for_sublayer",
        "_make_output_dense",
        "_masked_softmax",
    }
)

SWAPPED = "swapped"
REBUILT = "rebuilt on keras_mha"
MOVED = "moved from keras-hub's own class"
MOVED_STATUSES = (SWAPPED, REBUILT, MOVED)  # the layer runs on ours after the swap
ALREADY = "already keras_mha"
LEFT = "left on the built-in"
KEPT = "kept: keras-hub's own class, out of scope"

_lock = threading.RLock()
_depth = 0
_saved_new = None
_rebuilt = {}  # subclass of the built-in -> the same class on ours, or None
_warned = set()


# ------------------------------------------------------------------- construction
@contextlib.contextmanager
def swapped():
    """Constructs `keras_mha.MultiHeadAttention` wherever the built-in would be.

    While the context is active, `keras.layers.MultiHeadAttention(...)` (however it
    was imported) returns `keras_mha.MultiHeadAttention(...)` with the same arguments
    and `fully_masked_rows="builtin"` (a query row with no visible key gets what the
    built-in gives it),
    and a subclass of the built-in returns an instance of the same subclass rebuilt on
    ours, when it uses only protected names ours provides (others are constructed as
    they are, with a warning). Covers code that builds its own layers:

        with keras_mha.swapped():
            model = build_model()            # or keras.saving.load_model(path)

    It patches the built-in class for the whole process while active (nesting is
    allowed); construct models on other threads outside it.
    """
    global _depth, _saved_new
    with _lock:
        if _depth == 0:
            _saved_new = BUILTIN.__dict__.get("__new__")
            BUILTIN.__new__ = staticmethod(_new)
            hub.patch()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                hub.unpatch()
                if _saved_new is None:
                    del BUILTIN.__new__
                else:
                    BUILTIN.__new__ = _saved_new


def _new(cls, *args, **kwargs):
    """`BUILTIN.__new__` while `swapped()` is active.

    An object that is not an instance of `cls` is returned as it is: Python does not
    call `cls.__init__` on it, so ours is constructed exactly once, by its own class.
    """
    if cls is BUILTIN:
        return _as_builtin(layer_lib.MultiHeadAttention(*args, **kwargs), kwargs)
    target = rebuilt_class(cls)
    if target is not None:
        return _as_builtin(target(*args, **kwargs), kwargs)
    if _saved_new is not None:
        return _saved_new(cls, *args, **kwargs)
    return super(BUILTIN, cls).__new__(cls, *args, **kwargs)


def _as_builtin(layer, kwargs):
    """A layer built in the built-in's place gives a row with no visible key what the
    built-in gives it (`fully_masked_rows="builtin"`), unless its config says."""
    if "fully_masked_rows" not in kwargs:
        layer._fully_masked_rows = "builtin"
    return layer


def swap(model):
    """Returns a copy of `model` with every built-in attention layer swapped for ours.

    Args:
        model: A `keras.Model` holding `keras.layers.MultiHeadAttention` layers, at
            the top level or inside its own layers at any depth.

    Returns:
        A new model: same structure, configuration and weights (and compile settings),
        with `keras_mha.MultiHeadAttention` in place of each built-in layer and each
        eligible subclass rebuilt on ours. `model` itself is not changed.

    Raises:
        ValueError: `model` is not a `keras.Model`, or holds no layer to swap (with
            keras-hub's out-of-scope classes, `keras_mha.hub.OUT_OF_SCOPE`'s reasons).
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "Received an invalid value for argument `model`, expected a `keras.Model`. "
            f"Received: model={type(model).__name__}"
        )
    layers = attention_layers(model)
    if layers and all(hub.out_of_scope(x) for _, x in layers):
        reasons = {type(x).__name__: hub.out_of_scope(x) for _, x in layers}
        raise ValueError(
            "Received an invalid value for argument `model`, expected a model holding "
            f"an attention layer keras_mha moves. Received: model={model.name} ("
            + "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
            + ")"
        )
    if any(hub.is_hub_attention(layer) for _, layer in layers):
        result = _swap_in_memory(model)
    else:
        with tempfile.TemporaryDirectory(prefix="keras-mha-swap-") as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            result = _load_under_swapped(path, safe_mode=False)  # our own copy of the user's
    _keep_trainable(model, result)
    rows = swap_report(model, result)
    if not any(row["status"] in MOVED_STATUSES for row in rows):
        raise ValueError(
            "Received an invalid value for argument `model`, expected a model holding "
            f"a keras.layers.MultiHeadAttention to swap. Received: model={model.name} "
            f"({describe(rows)})"
        )
    return result


def _swap_in_memory(model):
    """The swap of a model holding keras-hub attention classes of their own: the
    model rebuilt from its config under `swapped()`, then its weights copied layer by
    layer, each keras-hub attention layer's through its table entry (`hub.table`):
    their variables differ from ours, so Keras's `.keras` loader cannot match them."""
    config = keras.saving.serialize_keras_object(model)
    compile_config = config.pop("compile_config", None)
    with swapped():
        result = keras.saving.deserialize_keras_object(config)
    _copy_weights(model, result, model.name)
    hub.describe_masks(result)
    # A keras-hub task compiles itself when constructed (its `compile` is its own).
    if compile_config is not None and type(result).compile is keras.Model.compile:
        result.compile_from_config(compile_config)
    return result


def _copy_weights(original, result, path):
    """Assigns `original`'s weights to `result`, pairing their layers child by child."""
    if isinstance(result, hub.HubAttention):
        result.port(original)
        return
    if isinstance(original, BUILTIN) and isinstance(result, layer_lib.MultiHeadAttention):
        result.set_weights(original.get_weights())
        return
    own = [v for v in original._trainable_variables + original._non_trainable_variables]
    new = [v for v in result._trainable_variables + result._non_trainable_variables]
    before = original._flatten_layers(include_self=False, recursive=False)
    after = result._flatten_layers(include_self=False, recursive=False)
    if len(own) != len(new) or len(before) != len(after):
        raise ValueError(
            f"The swapped model's layer {path} has {len(new)} weights and {len(after)} "
            f"sublayers where the original has {len(own)} and {len(before)}: their "
            "structures differ."
        )
    for source, target in zip(own, new):
        target.assign(keras.ops.convert_to_numpy(source.value))  # a copy, not a shared buffer
    _copy_assets(original, result)
    hub.carry_config_gaps(original, result)
    for old, fresh in zip(before, after):
        _copy_weights(old, fresh, f"{path}/{old.name}")


def _copy_assets(original, result):
    """What Keras's `.keras` files carry beside the weights (a tokenizer's vocabulary),
    from `original` to `result`: layer by layer, and through a keras-hub task's
    `preprocessor`, which its model does not track as a layer."""
    pairs = [(original, result)]
    before, after = (getattr(x, "preprocessor", None) for x in (original, result))
    if before is not None and after is not None:
        pairs += zip(
            before._flatten_layers(include_self=True), after._flatten_layers(include_self=True)
        )
    for old, new in pairs:
        if hasattr(old, "save_assets") and hasattr(new, "load_assets"):
            with tempfile.TemporaryDirectory(prefix="keras-mha-assets-") as assets:
                old.save_assets(assets)
                new.load_assets(assets)


def _keep_trainable(original, result):
    """Gives each layer of `result` its counterpart's `trainable` in `original`.

    Keras's `.keras` round trip can lose a `trainable=False` (on JAX, keras-hub's
    Whisper comes back with its frozen encoder position embedding trainable). Layers
    are paired child by child, attention layers excepted (their sublayers differ); a
    subtree whose children do not pair up is left as loaded.
    """
    if original.trainable != result.trainable:
        result.trainable = original.trainable
    if isinstance(original, BUILTIN | layer_lib.MultiHeadAttention) or hub.is_hub_attention(
        original
    ):
        return
    before = original._flatten_layers(include_self=False, recursive=False)
    after = result._flatten_layers(include_self=False, recursive=False)
    if len(before) != len(after):
        return
    for old, new in zip(before, after):
        if type(old).__name__ == type(new).__name__ or isinstance(
            new, layer_lib.MultiHeadAttention
        ):
            _keep_trainable(old, new)


def load_swapped(filepath, **kwargs):
    """`keras.saving.load_model(filepath, **kwargs)` under `swapped()`.

    A model holding keras-hub attention classes of its own loads as it is, then moves
    as `swap` moves it (their variables are not ours: Keras's loader cannot match them).
    """
    with zipfile.ZipFile(filepath) as archive:
        uses_keras_hub = _import_keras_hub_for(archive.read("config.json").decode())
    if uses_keras_hub:
        model = keras.saving.load_model(filepath, **kwargs)
        if any(hub.is_hub_attention(layer) for _, layer in attention_layers(model)):
            result = _swap_in_memory(model)
            _keep_trainable(model, result)
            return result
    return _load_under_swapped(filepath, **kwargs)


def _load_under_swapped(filepath, **kwargs):
    with swapped():
        return keras.saving.load_model(filepath, **kwargs)


def _import_keras_hub_for(config):
    """Imports keras-hub before a config that names it is deserialised under
    `swapped()`, which patches its attention classes only once they are imported;
    returns whether it names keras-hub."""
    text = config if isinstance(config, str) else json.dumps(config, default=str)
    if "keras_hub" not in text:
        return False
    import keras_hub  # noqa: F401

    return True


# ------------------------------------------------------------------ saving a swap
@keras.saving.register_keras_serializable(package="keras_mha")
class SwapOnLoad:
    """The config of a file written by `save_swapped`: a model config that is
    deserialised under `swapped()`. Never instantiated: `from_config` returns the model.
    """

    def get_config(self):  # required by the registration; never called
        return {}

    @classmethod
    def from_config(cls, config):
        _import_keras_hub_for(config)
        with swapped():
            model = keras.saving.deserialize_keras_object(config["model"])
        hub.describe_masks(model)
        return model


def save_swapped(model, filepath):
    """Saves `model` as a `.keras` file that loads with our attention layers in place.

    The file is what `model.save` writes, its model config wrapped so that it is
    deserialised under `swapped()`: user layers that create the built-in in their
    `__init__` create ours on load. It loads with `import keras_mha` and
    `keras.saving.load_model(filepath)` (also with `safe_mode=True`).
    """
    filepath = os.fspath(filepath)
    if not filepath.endswith(".keras"):
        raise ValueError(
            "Received an invalid value for argument `filepath`, expected a path ending "
            f"in `.keras`. Received: filepath={filepath}"
        )
    with tempfile.TemporaryDirectory(prefix="keras-mha-save-") as tmp:
        plain = os.path.join(tmp, "plain.keras")
        model.save(plain)
        wrapped = os.path.join(tmp, "swapped.keras")
        with zipfile.ZipFile(plain) as source, zipfile.ZipFile(wrapped, "w") as target:
            for item in source.infolist():
                data = source.read(item.filename)
                if item.filename == "config.json":
                    data = json.dumps(_wrap_config(json.loads(data))).encode()
                target.writestr(item, data)
        shutil.move(wrapped, filepath)


def _wrap_config(config):
    config = _restore_registered_names(config)
    return {
        "module": SwapOnLoad.__module__,
        "class_name": SwapOnLoad.__name__,
        "config": {"model": config},
        "registered_name": keras.saving.get_registered_name(SwapOnLoad),
        # Outside, where `load_model(compile=False)` looks for it.
        "compile_config": config.pop("compile_config", None),
    }


def _restore_registered_names(config):
    """A rebuilt subclass is saved under its original's registered name, so the file
    resolves the original class, which `swapped()` rebuilds again on load."""
    names = {
        (new.__module__, new.__name__): keras.saving.get_registered_name(original)
        for original, new in _rebuilt.items()
        if new is not None
    }

    def visit(node):
        if isinstance(node, dict):
            key = (node.get("module"), node.get("class_name"))
            if key in names and "registered_name" in node:
                node["registered_name"] = names[key]
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return config


# ---------------------------------------------------------------------- subclasses
def unsupported_names(cls):
    """The protected names of the built-in that subclass `cls` uses or overrides and
    that our layer does not provide with the same meaning (empty: it can be rebuilt)."""
    builtin_names = _protected_names(BUILTIN)
    ours_names = _protected_names(layer_lib.MultiHeadAttention)
    found = set()
    for klass in _subclass_chain(cls):
        for attr, value in vars(klass).items():
            if attr in builtin_names and attr not in PROTECTED_OVERRIDES and _is_code(value):
                found.add(attr)  # an override our layer would not call as the built-in does
            for code in _code_objects(value):
                found.update(n for n in _names(code) if n in builtin_names - ours_names)
    return sorted(found)


def rebuilt_class(cls):
    """`cls` (a subclass of the built-in) rebuilt on ours, or `None` if it uses
    protected names ours does not provide (a warning names them, once per class)."""
    with _lock:
        if cls not in _rebuilt:
            _rebuilt[cls] = None if unsupported_names(cls) else _rebase(cls)
        target = _rebuilt[cls]
    if target is None and cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"keras_mha.swapped: {cls.__qualname__} subclasses keras.layers."
            f"MultiHeadAttention and uses {', '.join(unsupported_names(cls))}, which "
            "keras_mha.MultiHeadAttention does not provide; it stays on the built-in.",
            stacklevel=3,
        )
    return target


def _subclass_chain(cls):
    return [k for k in cls.__mro__ if k is not BUILTIN and issubclass(k, BUILTIN)]


def _rebase(cls):
    """The classes between `cls` and the built-in, re-created with ours as the base."""
    mapping = {BUILTIN: layer_lib.MultiHeadAttention}
    for klass in reversed(_subclass_chain(cls)):
        bases = tuple(mapping.get(base, base) for base in klass.__bases__)
        mapping[klass] = _clone_class(klass, bases)
    return mapping[cls]


def _clone_class(klass, bases):
    namespace = {k: v for k, v in vars(klass).items() if k not in ("__dict__", "__weakref__")}
    new = type(klass)(klass.__name__, bases, namespace)
    new.__qualname__ = klass.__qualname__
    # Zero-argument `super()` reads the class from a `__class__` cell: point it at
    # the new class, or `super()` would look for the old one in the new MRO.
    for name, value in namespace.items():
        rebound = _rebind_class_cell(value, new)
        if rebound is not value:
            setattr(new, name, rebound)
    return new


def _rebind_class_cell(value, new):
    if isinstance(value, staticmethod | classmethod):
        inner = _rebind_class_cell(value.__func__, new)
        return value if inner is value.__func__ else type(value)(inner)
    if isinstance(value, property):
        parts = [_rebind_class_cell(f, new) if f else f for f in (value.fget, value.fset)]
        parts.append(_rebind_class_cell(value.fdel, new) if value.fdel else None)
        if all(a is b for a, b in zip(parts, (value.fget, value.fset, value.fdel))):
            return value
        return property(*parts, value.__doc__)
    if not isinstance(value, types.FunctionType):
        return value
    if "__class__" not in value.__code__.co_freevars:
        return value
    cells = list(value.__closure__)
    cells[value.__code__.co_freevars.index("__class__")] = types.CellType(new)
    function = types.FunctionType(
        value.__code__, value.__globals__, value.__name__, value.__defaults__, tuple(cells)
    )
    function.__kwdefaults__ = value.__kwdefaults__
    return functools.update_wrapper(function, value, updated=())


@functools.cache
def _protected_names(cls):
    """Single-underscore names a class (with its bases below `keras.layers.Layer`)
    defines as methods or properties, or its own code touches as attributes.

    Data that a decorator sets on the class (keras's and keras-hub's export
    decorators set `_api_export_path`, `_api_export_symbol_id`) is not behaviour.
    """
    names = set()
    for klass in cls.__mro__:
        if klass in keras.layers.Layer.__mro__:
            continue
        names.update(n for n, v in vars(klass).items() if _is_protected(n) and _is_code(v))
        for value in vars(klass).values():
            for code in _code_objects(value):
                names.update(n for n in _names(code) if _is_protected(n))
    return frozenset(names)


def _is_code(value):
    """Whether a class attribute is behaviour: a function, method or property."""
    return isinstance(value, types.FunctionType | staticmethod | classmethod | property)


def _is_protected(name):
    return name.startswith("_") and not name.startswith("__")


def _code_objects(value):
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    if isinstance(value, property):
        functions = [f for f in (value.fget, value.fset, value.fdel) if f]
    else:
        functions = [value]
    for function in functions:
        code = getattr(function, "__code__", None)
        if isinstance(code, types.CodeType):
            yield from _nested(code)


def _nested(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "LOAD_METHOD"})


def _names(code):
    """Attribute names a code object loads, stores, deletes or calls (`self._x`).

    Global names are not the class's API: a module-level `_build_proj_equation` in
    keras-hub's modules is its own copy of the built-in's module function.
    """
    return {
        op.argval
        for op in dis.get_instructions(code)
        if op.opname in _ATTRIBUTE_OPS or op.opname == "LOAD_SUPER_ATTR"
    }


# -------------------------------------------------------------------------- report
def attention_layers(model):
    """`(path, layer)` for each attention layer of `model` (the built-in, its
    subclasses, ours, keras-hub's moved and out-of-scope classes), depth first in
    tracking order. A path is made of layer names
    inside models and attribute names inside other layers (`block/att`)."""
    found = []

    def visit(layer, path):
        for name, child in _children(layer):
            child_path = f"{path}/{name}" if path else name
            if isinstance(
                child, BUILTIN | layer_lib.MultiHeadAttention | hub.HubAttention
            ) or hub.is_hub_attention(child):
                found.append((child_path, child))
            else:
                before = len(found)
                visit(child, child_path)
                # An out-of-scope class is kept, and listed, unless it only wraps
                # attention that moves (BLIP-2's QFormerAttention holds the built-in).
                if hub.out_of_scope(child) and len(found) == before:
                    found.append((child_path, child))

    visit(model, "")
    return found


def _children(layer):
    children = layer._flatten_layers(include_self=False, recursive=False)
    if isinstance(layer, keras.Model):
        return [(child.name, child) for child in children]
    names = {}
    attributes = [(a, v) for a, v in vars(layer).items() if a != "_layers"]
    attributes += list(getattr(layer, "_modules", {}).items())  # torch keeps sublayers there
    for attr, value in attributes:  # direct attributes first: `att` before `blocks[0]`
        if isinstance(value, keras.layers.Layer):
            names.setdefault(id(value), attr)
    for attr, value in attributes:
        if isinstance(value, list | tuple):
            for i, item in enumerate(value):
                names.setdefault(id(item), f"{attr}[{i}]")
    return [(names.get(id(child), child.name), child) for child in children]


def swap_report(original, result):
    """One dict per attention layer of `original`: `path`, `before` and `after` (class
    names), `status` (`SWAPPED`, `REBUILT`, `MOVED`, `ALREADY`, `LEFT` or `KEPT`),
    `config` (a summary) and `reason` (for `LEFT`: the protected names that kept it on
    the built-in; for `KEPT`: why keras-hub's class is out of scope)."""
    before, after = attention_layers(original), attention_layers(result)
    if len(before) != len(after):
        raise ValueError(
            f"The swapped model has {len(after)} attention layers where the original has "
            f"{len(before)}: their structures differ."
        )
    rows = []
    for (path, old), (_, new) in zip(before, after):
        reason = None
        if isinstance(old, layer_lib.MultiHeadAttention | hub.HubAttention):
            status = ALREADY
        elif isinstance(new, hub.HubAttention):
            status = MOVED
        elif isinstance(new, layer_lib.MultiHeadAttention):
            status = SWAPPED if type(old) is BUILTIN else REBUILT
        elif hub.out_of_scope(old):
            status, reason = KEPT, hub.out_of_scope(old)
        else:
            status = LEFT
            reason = "uses " + ", ".join(unsupported_names(type(old)))
        rows.append(
            {
                "path": path,
                "before": _class_name(old),
                "after": _class_name(new) + (" on keras_mha" if status == REBUILT else ""),
                "status": status,
                "config": None
                if status == KEPT
                else config_summary(new if isinstance(new, hub.HubAttention) else old),
                "reason": reason,
                # Where keras-hub's class and ours differ (the entry's notes).
                "notes": list(new.entry.notes) if isinstance(new, hub.HubAttention) else [],
            }
        )
    return rows


def describe(rows):
    """A short phrase for what a report found, e.g. "no attention layer"."""
    if not rows:
        return "no attention layer"
    counts = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return ", ".join(f"{n} {status}" for status, n in counts.items())


_SUMMARY_DEFAULTS = {
    "value_dim": None,
    "dropout": 0.0,
    "use_bias": True,
    "output_shape": None,
    "attention_axes": None,
    "sliding_window": None,
    "use_gate": False,
}


def config_summary(layer):
    """`num_heads=8, key_dim=64` and the arguments that differ from the defaults."""
    if isinstance(layer, hub.HubAttention):
        layer = layer.attention
    config = layer.get_config()
    parts = [f"num_heads={config['num_heads']}", f"key_dim={config['key_dim']}"]
    for key, default in _SUMMARY_DEFAULTS.items():
        value = config.get(key, default)
        if key == "value_dim" and value == config["key_dim"]:
            continue
        if key == "attention_axes" and value in ((1,), [1]):
            continue  # the default, once built on (B, T, dim) inputs
        if value != default and value not in ([], ()):
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def _class_name(layer):
    cls = type(layer)
    module = cls.__module__
    if cls is BUILTIN:
        return "keras.layers.MultiHeadAttention"
    if cls is layer_lib.MultiHeadAttention:
        return "keras_mha.MultiHeadAttention"
    if isinstance(layer, hub.HubAttention):
        return f"keras_mha.MultiHeadAttention ({layer.hub_class.rpartition('.')[2]})"
    return re.sub(r"^__main__\.", "", f"{module}.{cls.__qualname__}")
