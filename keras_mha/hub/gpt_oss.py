"""GPT-OSS: `GptOssAttention`.

Biases on every projection, learned sinks (`use_sinks`: keras-hub's `sinks` weight is
our `sinks/sinks`, one logit per query head, concatenated to each row's logits before
the softmax and dropped after it: our softmax denominator), YaRN RoPE (`truncate`
off, as GPT-OSS sets it), dropout on the attention output, and a window on the odd
layers: keras-hub keeps keys `s >= t - W` (with `t` the query's position,
`cache_update_index + t`, on both paths), `W` keys before the query plus its own,
our integer window `W + 1`.
"""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_query_heads"]
    head_dim = config["head_dim"] or dim // heads
    rotary_dim = (head_dim // 2) * 2
    window = config["sliding_window"]
    return dict(
        num_heads=heads,
        key_dim=head_dim,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=True,
        use_sinks=True,
        dropout=config["dropout"],
        dropout_on="output",
        sliding_window=window + 1 if window is not None and window > 0 else None,
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling={
            "type": "yarn",
            "factor": config["rope_scaling_factor"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        rope_dim=rotary_dim if rotary_dim < head_dim else None,
        kernel_initializer=common.clone(config["kernel_initializer"]),
    )


def _weights(layer):
    found = common.weights(layer, common.PUBLIC_PROJECTIONS)
    found["_sinks"] = [layer.sinks.value]
    return found


ADAPTERS = {
    "keras_hub.src.models.gpt_oss.gpt_oss_attention.GptOssAttention": Entry(
        options=_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=_weights,
        notes=(
            "keras-hub masks with a -1e9 logit (a row with no key left attends to the "
            "sink alone); ours drops masked keys: the same weights",
        ),
    ),
}
