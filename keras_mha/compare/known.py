"""Differences where the built-in is documented to be wrong, and how a comparison tells
them from a genuine difference.

One is known: on torch, the built-in's gradients through query rows with no key to
attend to (a padded query, a causal row that sees only padding). Its torch path masks
with an additive float mask, so those rows are uniform only because the large negative
number swallows their logits, and its backward still passes the logits' gradients on;
on JAX and TensorFlow it uses a `where` and passes none, as ours does on every backend
(docs/guide/masks.md, "Rows with no key to attend to"). The outputs agree; the weight
gradients do not, wherever such rows reach the loss.

A comparison on torch whose outputs and output masks agree and whose weight gradients
do not is `suspect`. It is then judged against a reference free of the defect: the
built-in on another installed backend, in its own process, on the same file, inputs and
cotangents (`keras_mha.compare.workers.run_reference`). `classify` calls the difference
known only when ours agrees with that reference within tolerance, in the outputs and
every weight gradient, and torch's built-in does not: a wrong gradient of ours anywhere,
or perturbed weights, still fails.
"""

import numpy as np

from keras_mha.compare.records import ATOL, _max_abs_diff

TORCH_FULLY_MASKED_ROWS = "builtin_torch_fully_masked_rows"
DOCS = "docs/guide/masks.md#rows-with-no-key-to-attend-to"

KNOWN = {
    TORCH_FULLY_MASKED_ROWS: {
        "backend": "torch",
        "difference": "Keras's torch attention gradients through query rows with no key to "
        "attend to",
        "docs": DOCS,
    },
}

# The backends whose built-in is free of the defect, in the order they are tried:
# tensorflow first, since it runs the reference's one eager gradient without compiling
# anything (benchmarks/results/reference_backend.md).
REFERENCE_BACKENDS = ("tensorflow", "jax")


def suspect(backend, result, atol=ATOL):
    """Whether an input case's result has the pattern of the known defect: on torch, the
    outputs within tolerance and their masks the same, the weight gradients not."""
    if backend != KNOWN[TORCH_FULLY_MASKED_ROWS]["backend"]:
        return False
    outputs, grads = result.get("max_abs_diff"), result.get("grad_max_abs_diff")
    if outputs is None or grads is None or result.get("masks_match") is not True:
        return False
    bound = atol * max(1.0, result.get("grad_scale") or 0.0)
    return outputs <= atol and grads > bound


def reference_backends(backend, installed):
    """The installed backends of `REFERENCE_BACKENDS` other than `backend`, in order.
    A case is judged against each in turn until one explains it: a model whose own
    code differs between backends elsewhere (keras-hub's attention gives a row with no
    key the values' mean on jax and a zero output on tensorflow: the guarantees page)
    is explained by the backend whose path matches torch's."""
    return [b for b in REFERENCE_BACKENDS if b != backend and b in installed]


def reference_backend(backend, installed):
    """The first of `reference_backends`, or `None`."""
    return next(iter(reference_backends(backend, installed)), None)


def classify(ours, builtin, reference, atol=ATOL):
    """The known difference that explains a suspect case, or `None`.

    Args:
        ours: `{"outputs": [...], "grads": [...]}`, NumPy, of the swapped model here.
        builtin: The same for the model as it is, here.
        reference: The same for the model as it is on another backend (plus its
            `"backend"`), on the same inputs and cotangents; `None` where none ran.
        atol: The tolerance (`ATOL`); gradients get `atol * max(1, max|gradient|)`.

    Returns:
        `None` unless ours matches the reference (outputs within `atol`, every weight
        gradient within its bound) and the built-in here does not; then a dict (plain
        data, for the JSON): `name`, `difference`, `docs`, `reference_backend`,
        `ours_vs_reference` and `builtin_vs_reference` (the largest weight-gradient
        differences), `tolerance` (the gradients' bound).
    """
    if reference is None:
        return None
    shapes = [np.shape(g) for g in reference["grads"]]
    if [np.shape(g) for g in ours["grads"]] != shapes or len(ours["outputs"]) != len(
        reference["outputs"]
    ):
        return None
    scale = max((float(np.max(np.abs(g))) for g in reference["grads"] if np.size(g)), default=0)
    bound = atol * max(1.0, scale)
    outputs = max(
        (_max_abs_diff(a, b) for a, b in zip(ours["outputs"], reference["outputs"])), default=0
    )
    ours_vs = max(
        (_max_abs_diff(a, b) for a, b in zip(ours["grads"], reference["grads"])), default=0
    )
    builtin_vs = max(
        (_max_abs_diff(a, b) for a, b in zip(builtin["grads"], reference["grads"])), default=0
    )
    if not (outputs <= atol and ours_vs <= bound and builtin_vs > bound):
        return None
    known = KNOWN[TORCH_FULLY_MASKED_ROWS]
    return {
        "name": TORCH_FULLY_MASKED_ROWS,
        "difference": known["difference"],
        "docs": known["docs"],
        "reference_backend": reference["backend"],
        "ours_vs_reference": ours_vs,
        "builtin_vs_reference": builtin_vs,
        "tolerance": bound,
    }


def describe(case_name, classification):
    """One line for a classified input case: the difference, the docs, the evidence.
    "The model as it is" is the file unswapped: the built-in's, or keras-hub's
    own attention, whose torch path is Keras's too."""
    c = classification
    return (
        f"{case_name} inputs: the weight gradients differ only where Keras is "
        f"documented wrong on torch, {c['difference']} ({c['docs']}); ours matches "
        f"the model as it is on {c['reference_backend']} to {c['ours_vs_reference']:.1e}, "
        f"which on torch is {c['builtin_vs_reference']:.1e} off it"
    )
