"""Shared test set-up: the backend in the header, the `gpu` marker's skip rule, and
which tests run on Keras's inference-only backends."""

import gc

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()
INFERENCE_BACKENDS = ("numpy", "openvino")


def _gpu_visible():
    if BACKEND == "jax":
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    if BACKEND == "torch":
        import torch

        return torch.cuda.is_available()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {BACKEND}"


def pytest_collection_modifyitems(config, items):
    # Keras's inference-only backends run only the tests marked for them, and the
    # training backends leave those out (tests/run_backends.py runs both).
    inference = BACKEND in INFERENCE_BACKENDS
    kept = [item for item in items if ("inference_backend" in item.keywords) == inference]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason=f"no GPU visible to the {BACKEND} backend")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# Keras's `quantize()` drops each float kernel it replaces, and `Layer.__delattr__` runs a
# full `gc.collect()` for every variable dropped (to free device buffers sooner). In a test
# process holding many objects each costs 0.3-1 s: keras-hub's tiny models spent 1,100 s of
# `make test` there (tests/test_hub.py, int8 on three backends). The tests read nothing
# that collection frees, so explicit collections are skipped; Python's automatic
# collection still runs.
@pytest.fixture(autouse=True)
def _no_explicit_gc_collect(monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
