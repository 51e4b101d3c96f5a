"""`keras_mha.packing_text`: text to packed rows with a keras-hub model's own tokenizer
(a tiny Llama SentencePiece vocabulary trained here, offline). Each document is the
tokens keras-hub's `LlamaCausalLMPreprocessor` makes of it, start and end tokens
included; a prompt is never learned; batches have a fixed `T`; bad input is rejected by
name; and a swapped, packed keras-hub Llama fed these batches gets, on every backend, the
summed loss keras-hub's own model and preprocessor give each text alone."""

import io
import warnings

import keras
import keras_hub
import numpy as np
import pytest
import sentencepiece
from helpers import to_numpy

import keras_mha
from keras_mha import hub, packing_text

WORDS = "the quick brown fox jumps over a lazy dog while cats sleep in warm sun".split()


def _corpus(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def proto():
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(200)),
        model_writer=model,
        vocab_size=len(WORDS) + 4,
        model_type="word",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<s>",
        eos_piece="</s>",
        minloglevel=2,
    )
    return model.getvalue()


@pytest.fixture(scope="module")
def tokenizer(proto):
    return keras_hub.models.LlamaTokenizer(proto=proto)


@pytest.fixture(scope="module")
def preprocessor(tokenizer):
    return keras_hub.models.LlamaCausalLMPreprocessor(tokenizer, sequence_length=64)


def _documents(rows):
    """The documents of packed rows, with their loss masks, in row order."""
    out = []
    for tokens, ids, mask in zip(rows["token_ids"], rows["segment_ids"], rows["loss_mask"]):
        for i in range(1, ids.max() + 1):
            out.append((tokens[ids == i].tolist(), mask[ids == i].tolist()))
    return out


@pytest.mark.once
def test_a_text_is_what_the_preprocessor_makes_of_it(tokenizer, preprocessor):
    texts = _corpus(20, seed=1)
    rows = packing_text.pack_text(texts, preprocessor, length=32)
    assert rows["token_ids"].shape[1] == 32
    expected = []
    for text in texts:
        n = len(tokenizer(text)) + 2
        made = keras_hub.models.LlamaCausalLMPreprocessor(tokenizer, sequence_length=n + 1)
        x, _, _ = made([text])
        ids = to_numpy(x["token_ids"])[0]
        expected.append(ids[: int(to_numpy(x["padding_mask"]).sum())].tolist())
    assert expected[0][0] == tokenizer.start_token_id
    assert expected[0][-1] == tokenizer.end_token_id
    documents = _documents(rows)
    assert sorted(d for d, _ in documents) == sorted(expected)
    for document, mask in documents:  # every token after the first is learned
        assert mask == [True] * (len(document) - 1) + [False]
    # A bare tokenizer adds what keras-hub's default preprocessor adds.
    same = packing_text.pack_text(texts, tokenizer, length=32)
    for key in rows:
        np.testing.assert_array_equal(same[key], rows[key])
    assert (rows["token_ids"][rows["segment_ids"] == 0] == tokenizer.pad_token_id).all()


@pytest.mark.once
def test_the_preprocessors_choice_of_start_and_end_tokens_is_kept(tokenizer):
    text = "the quick brown fox"
    ids = tokenizer(text).tolist()
    for start, end in [(False, True), (True, False), (False, False)]:
        pre = keras_hub.models.LlamaCausalLMPreprocessor(
            tokenizer, add_start_token=start, add_end_token=end
        )
        [(document, _)] = _documents(packing_text.pack_text([text], pre, length=16))
        expected = [tokenizer.start_token_id] * start + ids + [tokenizer.end_token_id] * end
        assert document == expected


@pytest.mark.once
def test_a_prompt_is_read_but_not_learned(tokenizer):
    import tensorflow as tf

    pairs = [("the quick fox", "jumps over"), ("a lazy dog", "sleeps in the sun"), ("", "cats")]
    rows = packing_text.pack_text(pairs, tokenizer, length=64)
    learned = []
    for ids, mask, targets in zip(rows["segment_ids"], rows["loss_mask"], rows["targets"]):
        for i in range(1, ids.max() + 1):
            learned.append(targets[(ids == i) & mask].tolist())
    expected = [tokenizer(r).tolist() + [tokenizer.end_token_id] for _, r in pairs]
    assert sorted(learned) == sorted(expected)
    # keras-hub's dict format, and a tf.data dataset of pairs, give the same rows.
    dicts = [{"prompts": p, "responses": r} for p, r in pairs]
    dataset = tf.data.Dataset.from_tensor_slices(([p for p, _ in pairs], [r for _, r in pairs]))
    for same in (dicts, dataset):
        other = packing_text.pack_text(same, tokenizer, length=64)
        for key in rows:
            np.testing.assert_array_equal(other[key], rows[key])


@pytest.mark.once
@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_a_document_longer_than_the_row_is_split_or_truncated(tokenizer, overflow):
    text = " ".join(WORDS)  # 17 tokens with start and end
    length = 8
    rows = packing_text.pack_text([text], tokenizer, length=length, overflow=overflow)
    whole = [tokenizer.start_token_id] + tokenizer(text).tolist() + [tokenizer.end_token_id]
    documents = [d for d, _ in _documents(rows)]
    if overflow == "truncate":
        assert documents == [whole[:length]]
    else:
        pieces = [whole[s : s + length] for s in range(0, len(whole), length)]
        assert sorted(documents) == sorted(pieces)


@pytest.mark.once
def test_batches_have_a_fixed_length_and_hold_every_row(tokenizer):
    texts = _corpus(40, seed=2)
    rows = packing_text.pack_text(texts, tokenizer, length=24)
    seen = []
    for x, y, weights in packing_text.batches(texts, tokenizer, 24, batch_size=3, seed=0):
        assert set(x) == {"token_ids", "padding_mask"}
        assert x["token_ids"].shape[1] == 24 and 1 <= len(x["token_ids"]) <= 3
        assert y.shape == x["token_ids"].shape == weights.shape
        assert weights.dtype == np.float32
        seen.extend(zip(x["token_ids"].tolist(), x["padding_mask"].tolist()))
    expected = list(zip(rows["token_ids"].tolist(), rows["segment_ids"].tolist()))
    assert sorted(seen) == sorted(expected)
    # Buffers: each packed on its own, every document still once.
    buffered = packing_text.batches(texts, tokenizer, 24, batch_size=3, buffer_size=7)
    documents = [
        tokens[ids == i].tolist()
        for x, _, _ in buffered
        for tokens, ids in zip(x["token_ids"], x["padding_mask"])
        for i in range(1, ids.max() + 1)
    ]
    assert sorted(documents) == sorted(d for d, _ in _documents(rows))


@pytest.mark.once
def test_the_progress_bar_shows_on_a_terminal_only(tokenizer, monkeypatch, capsys):
    texts = _corpus(5, seed=3)
    quiet = packing_text.tokenize(texts, tokenizer, progress=True)  # not a terminal
    assert capsys.readouterr().err == ""
    started = []
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    import rich.progress

    monkeypatch.setattr(rich.progress.Progress, "start", lambda self: started.append(self))
    shown = packing_text.tokenize(texts, tokenizer, progress=True)
    assert len(started) == 1
    assert started[0].tasks[0].completed == len(texts)
    assert [d.tolist() for d, _ in shown] == [d.tolist() for d, _ in quiet]
    packing_text.tokenize(texts, tokenizer)  # off by default
    assert len(started) == 1


@pytest.mark.once
@pytest.mark.parametrize(
    "texts, length, name, expected",
    [
        (["the fox", ""], 8, "texts", "at least one token.*at index 1"),
        ([("the fox", "")], 8, "texts", "at least one token.*at index 0"),
        ([3], 8, "texts", "strings"),
        (["the fox"], 1, "length", "at least 2"),
        (["the fox"], 2.5, "length", "at least 2"),
    ],
)
def test_bad_input_is_rejected_by_name(tokenizer, texts, length, name, expected):
    with pytest.raises(ValueError, match=rf"argument `{name}`, expected .*{expected}"):
        packing_text.pack_text(texts, tokenizer, length)


@pytest.mark.once
def test_a_tokenizer_without_a_pad_id_is_rejected(proto):
    bare = keras_hub.tokenizers.SentencePieceTokenizer(proto=proto)
    with pytest.raises(ValueError, match=r"argument `tokenizer`, expected .*pad token id"):
        packing_text.pack_text(["the fox"], bare, 8)
    with pytest.raises(ValueError, match=r"argument `tokenizer`, expected .*pad token id"):
        next(packing_text.batches(["the fox"], bare, 8, batch_size=2))
    with pytest.raises(ValueError, match=r"argument `batch_size`"):
        next(packing_text.batches(["the fox"], bare, 8, batch_size=0))


def test_a_packed_llama_learns_each_text_as_keras_hub_does_alone(tokenizer):
    """The summed loss over packed batches from text equals the sum over texts of the
    loss keras-hub's own model gives each, made by its own preprocessor."""
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
    )
    model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = hub.set_packed(keras_mha.swap(model))
    texts = _corpus(12, seed=4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    total = 0.0
    for x, y, weights in packing_text.batches(texts, tokenizer, 32, batch_size=2):
        total += float(to_numpy(loss(y, packed(x), sample_weight=weights)))
    # Each text alone in a row of its own, padded after it to the longest (causal: the
    # padding changes none of its logits, and weighs 0).
    longest = max(len(tokenizer(text)) for text in texts) + 2
    made = keras_hub.models.LlamaCausalLMPreprocessor(tokenizer, sequence_length=longest)
    x, y, weights = made(texts)
    assert to_numpy(x["padding_mask"]).sum(axis=1).min() < longest  # some rows padded
    alone = float(to_numpy(loss(y, model(x), sample_weight=weights)))
    np.testing.assert_allclose(total, alone, rtol=1e-5)
    # And keras-hub's fit trains on the batches as a dataset, read again each epoch.
    packed.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    data = packing_text.dataset(texts, tokenizer, 32, batch_size=2, seed=0)
    history = packed.fit(data, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert history.history["loss"][1] < history.history["loss"][0]
