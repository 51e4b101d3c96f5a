"""keras-hub language models, unswapped against swapped onto keras_mha (`keras_mha.swap`).

A narrow Llama and a Gemma 3 (2 layers, hidden 256, 4 heads of 64, vocabulary 1000,
random weights), each as keras-hub's `CausalLM` with `preprocessor=None`, two ways:
`unswapped` (keras-hub's own attention classes) and `swapped` (`keras_mha.swap`, whose
decoder blocks pass our layer their masks described).

- Train step: `train_on_batch` with SGD, one row of T tokens (T = 2048, 8192, 16384), its
  last quarter padded (padding mask and zero sample weights there). One step at T=64 sets
  the memory baseline; then a warm-up step at T (compiles) and `--steps` timed steps, the
  median counting. Memory: the growth of the process's peak RSS (`ru_maxrss`) over that
  baseline.
- Generate: `generate()` of 64 tokens (greedy) after a 4096-token prompt, once to
  compile, then `GENERATE_REPEATS` timed calls, the median counting (one call alone
  moved by 10-30% between runs).
- `--floor` (train steps only; writes `hub_lm_floor.*`): also the swapped model with
  the attention itself replaced by a zero output (`floor`): the time and memory of
  everything else in the step, below which no attention can bring the model.

Every (model, way, case) runs in a fresh process per backend, one at a time. A process
that outgrows `--memory-limit-gib` of resident memory (16 GiB: the machine has 24) or runs
past `--time-limit-s` is stopped and reported as such.

    .venv/bin/python benchmarks/hub_lm.py                      # writes results/hub_lm.*
    .venv/bin/python benchmarks/hub_lm.py --dry-run            # toy sizes, checks it runs
    .venv/bin/python benchmarks/hub_lm.py --backends jax --lengths 2048 --models llama
    .venv/bin/python benchmarks/hub_lm.py --floor --lengths 8192 --no-generate
"""

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run as bench  # noqa: E402  (benchmarks/run.py: a worker process under memory and time limits)

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("llama", "gemma3")
WAYS = ("unswapped", "swapped")
FLOOR = "floor"
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FULL = dict(layers=2, hidden=256, heads=4, vocab=1000, prompt=4096, new_tokens=64)
TOY = dict(layers=1, hidden=32, heads=2, vocab=64, prompt=32, new_tokens=4)
LENGTHS = (2048, 8192, 16384)
TOY_LENGTHS = (64,)
BASELINE = 64
GENERATE_REPEATS = 3


def build(model, sizes):
    import keras_hub

    models = keras_hub.models
    common = dict(
        vocabulary_size=sizes["vocab"],
        num_layers=sizes["layers"],
        hidden_dim=sizes["hidden"],
        intermediate_dim=2 * sizes["hidden"],
        num_key_value_heads=sizes["heads"],
    )
    if model == "llama":
        backbone = models.LlamaBackbone(num_query_heads=sizes["heads"], **common)
        return models.LlamaCausalLM(backbone, preprocessor=None)
    backbone = models.Gemma3Backbone(
        num_query_heads=sizes["heads"],
        head_dim=sizes["hidden"] // sizes["heads"],
        image_size=16,
        vision_encoder=None,
        use_sliding_window_attention=True,
        sliding_window_size=1024,
        **common,
    )
    return models.Gemma3CausalLM(backbone=backbone, preprocessor=None)


def _rows(length, vocab, padded_quarter=True):
    import numpy as np

    rng = np.random.default_rng(0)
    token_ids = rng.integers(1, vocab, (1, length)).astype("int32")
    mask = np.ones((1, length), "int32")
    if padded_quarter:
        mask[:, length - length // 4 :] = 0
    return {"token_ids": token_ids * mask, "padding_mask": mask}, token_ids, mask


def _peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(model_name, way, case, length, steps, sizes):
    """Runs one measurement in this process; prints one JSON line."""
    import warnings

    import keras

    import keras_mha

    keras.utils.set_random_seed(0)
    model = build(model_name, sizes)
    if way in ("swapped", FLOOR):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = keras_mha.swap(model)
    if way == FLOOR:  # the attention's output, zeros of its shape: no attention at all
        from keras_mha import layer

        def no_attention(query, key, value, **kwargs):
            return query[..., : value.shape[-1]] * 0.0, None

        layer.kernels.attention = no_attention
    if case == "generate":
        inputs, _, _ = _rows(sizes["prompt"] + sizes["new_tokens"], sizes["vocab"], False)
        inputs["padding_mask"][:, sizes["prompt"] :] = 0
        inputs["token_ids"] *= inputs["padding_mask"]
        model.compile(sampler="greedy")
        # keras-hub 0.32's Gemma3CausalLM.generate without a preprocessor fails on its
        # own output unless the prompt is stripped (swapped or not).
        extra = {"strip_prompt": True} if model_name == "gemma3" else {}
        model.generate(inputs, stop_token_ids=None, **extra)  # compiles
        times = []
        for _ in range(GENERATE_REPEATS):
            start = time.perf_counter()
            out = model.generate(inputs, stop_token_ids=None, **extra)
            times.append(time.perf_counter() - start)
        generated = int((keras.ops.convert_to_numpy(out["padding_mask"]) > 0).sum())
        return {"seconds": statistics.median(times), "times": times, "tokens": generated}
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    small, labels, mask = _rows(BASELINE, sizes["vocab"])
    model.train_on_batch(small, labels, sample_weight=mask)
    baseline = _peak_mib()
    inputs, labels, mask = _rows(length, sizes["vocab"])
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss = model.train_on_batch(inputs, labels, sample_weight=mask, return_dict=True)["loss"]
        if i:  # the first step compiles
            times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "times": times,
        "peak_growth_mib": _peak_mib() - baseline,
        "loss": float(loss),
    }


def spawn(backend, worker_args, args, script=__file__):
    """`worker_args` of `script` run in a fresh process under `args.memory_limit_gib` and
    `args.time_limit_s`: its result, or `{"error": why}`."""
    try:
        result = bench._spawn(
            backend,
            worker_args,
            memory_limit_gib=args.memory_limit_gib,
            time_limit_s=args.time_limit_s,
            script=script,
        )
    except RuntimeError as error:  # the worker failed: its last line says why
        return {"error": str(error).strip().splitlines()[-1][:200]}
    return {"error": result["failed"]} if "failed" in result else result


def _run(backend, model, way, case, length, args):
    worker_args = ["--worker", model, way, case, str(length), "--steps", str(args.steps)]
    worker_args += ["--dry-run"] if args.dry_run else []
    return spawn(backend, worker_args, args)


def _cell(result, key, fmt):
    return "—" if "error" in result else fmt.format(result[key])


def report(rows, sizes, command, date=None):
    date = date or datetime.date.today()
    lines = [
        "# keras-hub language models: unswapped against swapped",
        "",
        f"Measured {date} on {platform.node()} ({os.cpu_count()} cores), "
        f"`{command}` (sizes {sizes}).",
        "",
        "| backend | model | case | unswapped s | swapped s | time ratio | "
        "unswapped MiB | swapped MiB | memory ratio | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        un, sw = row["unswapped"], row["swapped"]
        ratio = mem = "—"
        if "error" not in un and "error" not in sw:
            ratio = f"{sw['seconds'] / un['seconds']:.2f}x"
            if "peak_growth_mib" in un:
                mem = f"{sw['peak_growth_mib'] / max(un['peak_growth_mib'], 1.0):.2f}x"
        errors = [
            f"{w}: {r['error']}" for w, r in (("unswapped", un), ("swapped", sw)) if "error" in r
        ]
        lines.append(
            f"| {row['backend']} | {row['model']} | {row['case']} | "
            f"{_cell(un, 'seconds', '{:.2f}')} | {_cell(sw, 'seconds', '{:.2f}')} | {ratio} | "
            f"{_cell(un, 'peak_growth_mib', '{:.0f}') if row['case'] != 'generate' else ''} | "
            f"{_cell(sw, 'peak_growth_mib', '{:.0f}') if row['case'] != 'generate' else ''} | "
            f"{mem} | {'; '.join(errors)} |"
        )
    floors = [row for row in rows if FLOOR in row]
    if floors:
        lines += [
            "",
            "Floor: the swapped model with its attention replaced by a zero output (the "
            "rest of the step), against the unswapped model.",
            "",
            "| backend | model | case | floor s | floor / unswapped time | floor MiB | "
            "floor / unswapped memory |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in floors:
            un, fl = row["unswapped"], row[FLOOR]
            if "error" in un or "error" in fl:
                lines.append(
                    f"| {row['backend']} | {row['model']} | {row['case']} | — | — | — | — |"
                )
                continue
            lines.append(
                f"| {row['backend']} | {row['model']} | {row['case']} | {fl['seconds']:.2f} | "
                f"{fl['seconds'] / un['seconds']:.2f}x | {fl['peak_growth_mib']:.0f} | "
                f"{fl['peak_growth_mib'] / max(un['peak_growth_mib'], 1.0):.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--lengths", nargs="+", type=int)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--floor", action="store_true", help="also the attention-free floor")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--time-limit-s", type=float, default=900.0)
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "WAY", "CASE", "LENGTH"))
    args = parser.parse_args(argv)
    sizes = TOY if args.dry_run else FULL
    if args.worker:
        model, way, case, length = args.worker
        result = worker(model, way, case, int(length), args.steps, sizes)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    lengths = args.lengths or (TOY_LENGTHS if args.dry_run else LENGTHS)
    command = "benchmarks/hub_lm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    cases = [("train", n) for n in lengths] + ([] if args.no_generate else [("generate", 0)])
    rows = []
    for backend in args.backends:
        for model in args.models:
            for case, length in cases:
                row = {"backend": backend, "model": model, "case": case, "length": length}
                if case == "train":
                    row["case"] = f"train T={length}"
                ways = WAYS + ((FLOOR,) if args.floor and case == "train" else ())
                for way in ways:
                    row[way] = _run(backend, model, way, case, length, args)
                    print(backend, model, row["case"], way, row[way], flush=True)
                rows.append(row)
    if args.dry_run:
        print(report(rows, sizes, command))
        return 0
    os.makedirs(args.out, exist_ok=True)
    name = "hub_lm_floor" if args.floor else "hub_lm"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        record = {"date": str(datetime.date.today()), "command": command.strip()}
        json.dump({**record, "sizes": sizes, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(report(rows, sizes, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
