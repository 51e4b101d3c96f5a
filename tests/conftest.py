"""Shared test set-up: the backend in the header, the `gpu` marker's skip rule."""

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()


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
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason=f"no GPU visible to the {BACKEND} backend")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
