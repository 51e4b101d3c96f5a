"""From text to packed rows with a keras-hub model's own tokenizer.

`keras_mha.packing.pack` packs token ids; this module makes them from text the way the
model's `CausalLMPreprocessor` does (its tokenizer, its start and end tokens), masks
prompts out of the loss, and hands the rows to `fit` in batches:

    preprocessor = keras_hub.models.LlamaCausalLMPreprocessor.from_preset(...)
    lm = keras_mha.hub.set_packed(keras_mha.swap(causal_lm))
    lm.fit(packing_text.dataset(texts, preprocessor, length=4096, batch_size=2))

or, all rows in memory, `lm.fit(*packing_text.fit_arrays(rows), batch_size=2)` with
`rows = packing_text.pack_text(texts, preprocessor, length=4096)`. (keras-hub's
`fit` takes arrays or a `tf.data` / grain dataset, not a Python generator:
`batches` is for Keras models of your own.)

Each text (a `str`, or a `tf.data` string scalar) is one document:
`[start] + tokens + [end]`, every token after the first learned. Each `(prompt,
response)` pair (a tuple, or keras-hub's `{"prompts": ..., "responses": ...}`) is one
document `[start] + prompt + response + [end]` in which only the response and its end
token are learned.
"""

import sys

import numpy as np

from keras_mha import checks, packing


def tokenize(texts, tokenizer, progress=False):
    """Token ids and target masks of each document, as the model's preprocessor adds
    start and end tokens.

    Args:
        texts: an iterable (a list, a generator, a `tf.data.Dataset`) of strings, or of
            `(prompt, response)` pairs (tuples, or dicts with keys `"prompts"` and
            `"responses"`, keras-hub's format).
        tokenizer: a keras-hub `CausalLMPreprocessor` (its `tokenizer`, and its
            `add_start_token` / `add_end_token` choices are used) or a keras-hub
            tokenizer (start and end tokens added where it has them).
        progress: show a progress bar (rich) while tokenizing, when writing to a
            terminal.

    Returns:
        A list of `(token_ids, target_mask)` pairs of 1-d NumPy arrays (int32, bool):
        `target_mask` is `False` at the tokens not to be learned (the start token, a
        prompt's tokens).

    Raises:
        ValueError: a text, or a pair's response, holds no token (argument `texts`).
    """
    tokenizer, start, end = _special_tokens(tokenizer)
    documents = []
    with _progress(progress, _size(texts)) as advance:
        for i, text in enumerate(texts):
            prompt, response = _prompt_and_response(text, i)
            prompt_ids = _ids(tokenizer, prompt) if prompt is not None else _NONE
            response_ids = _ids(tokenizer, response)
            if not len(response_ids):
                what = "a pair whose response" if prompt is not None else "a text that"
                raise checks.invalid(
                    "texts",
                    "texts that tokenize to at least one token",
                    f"{what} tokenizes to none ({response!r})",
                    extra=f"at index {i}",
                )
            head = np.concatenate([start, prompt_ids]).astype("int32")
            tail = np.concatenate([response_ids, end]).astype("int32")
            mask = np.concatenate([np.zeros(len(head), bool), np.ones(len(tail), bool)])
            documents.append((np.concatenate([head, tail]), mask))
            advance()
    return documents


def pack_text(texts, tokenizer, length, overflow="split", progress=False):
    """Packs texts, or prompt/response pairs, into rows of `length` tokens.

    The documents are tokenized (`tokenize`) and packed first-fit decreasing
    (`keras_mha.packing.pack`, with the tokenizer's pad id); a pair's prompt is read
    but not learned (`loss_mask` is `False` where the next token is the prompt's).

    Args:
        texts: strings or `(prompt, response)` pairs, see `tokenize`.
        tokenizer: a keras-hub `CausalLMPreprocessor` or tokenizer, see `tokenize`.
        length: tokens per row, `T`: at least 2 (a token and its target).
        overflow: a document longer than `length` is "split" into pieces of at most
            `length` tokens (each its own document) or "truncate"d to its first
            `length` tokens.
        progress: show a progress bar while tokenizing, when writing to a terminal.

    Returns:
        `keras_mha.packing.pack`'s dict of `(R, length)` arrays: `token_ids`,
        `segment_ids`, `positions`, `targets`, `loss_mask`.
    """
    length = _length(length)
    checks.one_of("overflow", overflow, ("split", "truncate"))
    tokenizer_, _, _ = _special_tokens(tokenizer)
    pad_id = _pad_id(tokenizer_)
    documents = tokenize(texts, tokenizer, progress=progress)
    return packing.pack(
        [d for d, _ in documents],
        length,
        pad_id=pad_id,
        overflow=overflow,
        target_masks=[m for _, m in documents],
    )


def fit_arrays(rows):
    """`(x, y, sample_weight)` of packed rows for a model made by `keras_mha.hub.set_packed`:
    `x = {"token_ids": ..., "padding_mask": segment_ids}`, `y` the targets and the loss
    mask (float32) as sample weights."""
    x = {"token_ids": rows["token_ids"], "padding_mask": rows["segment_ids"]}
    return x, rows["targets"], rows["loss_mask"].astype("float32")


def batches(
    texts,
    tokenizer,
    length,
    batch_size,
    overflow="split",
    buffer_size=None,
    shuffle=True,
    seed=None,
    progress=False,
):
    """Yields packed batches of fixed `length` for `fit`, made from text.

    Documents are read `buffer_size` at a time (all at once when `None`), each buffer
    packed (`pack_text`) and its rows yielded `batch_size` at a time (the buffer's last
    batch may hold fewer rows), as `(x, y, sample_weight)` tuples (`fit_arrays`). A
    generator is read once: give `fit` one epoch of it, or a new one per epoch.

    Args:
        texts: strings or `(prompt, response)` pairs, see `tokenize`.
        tokenizer: a keras-hub `CausalLMPreprocessor` or tokenizer, see `tokenize`.
        length: tokens per row, `T` (at least 2).
        batch_size: rows per batch.
        overflow: "split" or "truncate" documents longer than `length`.
        buffer_size: documents packed together (`None`: all of them). Larger buffers
            fill rows better.
        shuffle: shuffle each buffer's rows (first-fit decreasing puts the longest
            documents first).
        seed: the shuffle's seed.
        progress: show a progress bar while tokenizing, when writing to a terminal.

    Yields:
        `(x, y, sample_weight)`: `x` a dict of `token_ids` and `padding_mask` (the
        segment ids), each `(B, length)` int32; `y` `(B, length)` int32 targets;
        `sample_weight` `(B, length)` float32, 1 where the target is learned.
    """
    length = _length(length)
    batch_size = checks.positive_int("batch_size", batch_size)
    buffer_size = checks.positive_int("buffer_size", buffer_size, allow_none=True)
    checks.one_of("overflow", overflow, ("split", "truncate"))
    _pad_id(_special_tokens(tokenizer)[0])
    rng = np.random.default_rng(seed)
    for buffer in _buffers(texts, buffer_size):
        rows = pack_text(buffer, tokenizer, length, overflow=overflow, progress=progress)
        order = rng.permutation(len(rows["token_ids"])) if shuffle else None
        if order is not None:
            rows = {k: v[order] for k, v in rows.items()}
        for s in range(0, len(rows["token_ids"]), batch_size):
            yield fit_arrays({k: v[s : s + batch_size] for k, v in rows.items()})


def dataset(texts, tokenizer, length, batch_size, **kwargs):
    """`batches` as a `tf.data.Dataset` (what keras-hub's `fit` takes), read again at
    each epoch.

    Args:
        texts: as for `batches`.
        tokenizer: as for `batches`.
        length: as for `batches`.
        batch_size: as for `batches`.
        **kwargs: `batches`' other arguments (`overflow`, `buffer_size`, `shuffle`,
            `seed`, `progress`).

    Returns:
        A `tf.data.Dataset` of `(x, y, sample_weight)` batches of shape `(None, length)`.
    """
    import tensorflow as tf

    length = _length(length)
    batch_size = checks.positive_int("batch_size", batch_size)
    _pad_id(_special_tokens(tokenizer)[0])
    texts = list(texts) if not hasattr(texts, "as_numpy_iterator") else texts
    ids = tf.TensorSpec((None, length), tf.int32)
    signature = (
        {"token_ids": ids, "padding_mask": ids},
        ids,
        tf.TensorSpec((None, length), tf.float32),
    )
    return tf.data.Dataset.from_generator(
        lambda: batches(texts, tokenizer, length, batch_size, **kwargs),
        output_signature=signature,
    )


# ----------------------------------------------------------------------- helpers
_NONE = np.zeros(0, "int32")


def _length(length):
    if not checks._is_int(length) or length < 2:
        raise checks.invalid(
            "length", "an integer of at least 2 (one token and its target)", length
        )
    return int(length)


def _special_tokens(tokenizer):
    """`(tokenizer, start, end)`: the tokenizer and the start and end ids (arrays of
    0 or 1 id) that the preprocessor (or, for a tokenizer, keras-hub's default
    `CausalLMPreprocessor`) adds."""
    add_start = add_end = True
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer, "add_start_token"):
        add_start = bool(tokenizer.add_start_token)
        add_end = bool(getattr(tokenizer, "add_end_token", True))
        tokenizer = tokenizer.tokenizer
    if not callable(tokenizer):
        raise checks.invalid(
            "tokenizer",
            "a keras-hub tokenizer or `CausalLMPreprocessor`",
            type(tokenizer).__name__,
        )
    start = getattr(tokenizer, "start_token_id", None)
    end = getattr(tokenizer, "end_token_id", None)
    return (
        tokenizer,
        np.array([start] if add_start and start is not None else [], "int32"),
        np.array([end] if add_end and end is not None else [], "int32"),
    )


def _pad_id(tokenizer):
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        raise checks.invalid(
            "tokenizer",
            "a tokenizer with a pad token id (`tokenizer.pad_token_id`)",
            type(tokenizer).__name__,
            extra="whose `pad_token_id` is None",
        )
    return int(pad_id)


def _text(value):
    """A Python `str` from a `str`, `bytes` or a string scalar tensor (tf.data)."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    return value


def _prompt_and_response(item, index):
    if isinstance(item, dict) and set(item) == {"prompts", "responses"}:
        return _checked_text(item["prompts"], index), _checked_text(item["responses"], index)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return _checked_text(item[0], index), _checked_text(item[1], index)
    return None, _checked_text(item, index)


def _checked_text(value, index):
    text = _text(value)
    if not isinstance(text, str):
        raise checks.invalid(
            "texts",
            'strings, or (prompt, response) pairs of strings (tuples or dicts with keys "prompts" '
            'and "responses")',
            type(value).__name__,
            extra=f"at index {index}",
        )
    return text


def _ids(tokenizer, text):
    if not text:
        return _NONE
    ids = tokenizer(text)
    if hasattr(ids, "numpy"):
        ids = ids.numpy()
    return np.asarray(ids, "int32").reshape(-1)


def _size(texts):
    try:
        return len(texts)
    except TypeError:
        return None


def _buffers(texts, size):
    buffer = []
    for item in texts:
        buffer.append(item)
        if size is not None and len(buffer) == size:
            yield buffer
            buffer = []
    if buffer:
        yield buffer


class _progress:
    """A rich progress bar over documents while `enabled` and stderr is a terminal;
    entering gives the function that advances it by one."""

    def __init__(self, enabled, total):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task("tokenizing", total=total)

    def __enter__(self):
        if self.bar is None:
            return lambda: None
        self.bar.start()
        return lambda: self.bar.advance(self.task)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
