"""Eager calls of the chunked kernel, compiled once per configuration (JAX).

Outside `jax.jit`, JAX's `lax.fori_loop` traces and compiles its body on every call
(the body is a new closure each time), and every op around it compiles once per
shape. So an eager call that lands on the chunked kernel paid about a compile on
every call, same shapes or not (benchmarks/results/jax_eager_chunk_loop.md). Here
such a call runs through one `jax.jit` per configuration: the kernel's options and
the mask's static parts (causality, window, a Python-int offset) are its cache key,
the tensors (query, key, value, bias, sinks, dropout seed, the mask's tensors) its
arguments. `jax.jit` then compiles once per shape and dtype, and repeated calls run
the compiled program.

Calls with a score function are left as they are: a `score_mod` may read a tensor it
captured, whose value can change between calls, which a cached program would hold as a
constant from its first call. A block mask's `mask_mod` is compiled with it: its block
map, made once from what the function reads, holds only while that does not change.
"""

import dataclasses
import functools

from keras import ops

from keras_mha.kernels import trim

# The fields of an `AttentionMask` that may hold tensors (the arguments of the
# compiled call); the others are static and part of its cache key.
_MASK_TENSORS = ("query_valid", "key_valid", "offset", "dense", "query_segments", "key_segments")


def applies(query, score_mod):
    """Whether a call of the chunked kernel can run compiled: it is eager, and it has
    no score function."""
    return score_mod is None and trim.holds_data(query)


def attention(kernel, query, key, value, *, mask=None, bias=None, sinks=None, seed=None, **options):
    """`kernel(query, key, value, mask=..., ..., **options)` (the chunked kernel),
    through the compiled program of its configuration. `options` are the kernel's
    other arguments, Python values; where one is not hashable (a tensor given as the
    scale, say), the call runs as it is."""
    names, tensors, template = (), (), mask
    if mask is not None:
        names = tuple(f for f in _MASK_TENSORS if not _static(getattr(mask, f)))
        tensors = tuple(_tensor(getattr(mask, f)) for f in names)
        template = dataclasses.replace(mask, **dict.fromkeys(names))
    config = (kernel, template, names, tuple(sorted(options.items())))
    try:
        hash(config)
    except TypeError:
        return kernel(query, key, value, mask=mask, bias=bias, sinks=sinks, seed=seed, **options)
    arrays = (query, key, value, bias, sinks, seed)
    return _compiled(*config)(*(_tensor(x) for x in arrays), tensors)


def _static(value):
    """Whether a mask field is a Python value (part of the cache key), not a tensor."""
    return value is None or isinstance(value, (bool, int))


def _tensor(x):
    """`x` as the backend's array (a Keras variable is not one `jax.jit` takes)."""
    return None if x is None else ops.convert_to_tensor(x)


@functools.lru_cache(maxsize=64)
def _compiled(kernel, template, names, options):
    import jax

    def run(query, key, value, bias, sinks, seed, tensors):
        mask = template
        if mask is not None:
            mask = dataclasses.replace(mask, **dict(zip(names, tensors)))
        return kernel(
            query, key, value, mask=mask, bias=bias, sinks=sinks, seed=seed, **dict(options)
        )

    return jax.jit(run)
