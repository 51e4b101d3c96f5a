"""The `keras-mha` command line, a thin layer over `keras_mha.compare`.

    keras-mha compare [--backend {all,tensorflow,jax,torch}] [--quick] [--repeats N]
                      [--json PATH] [--plot PATH] [--cases NAME,...]
    keras-mha compare --model IN.keras [--import MODULE ...] [--inputs FILE.npz]
                      [--backend ...] [--repeats N] [--no-memory] [--json PATH] [--plot PATH]
    keras-mha swap IN.keras OUT.keras [--import MODULE ...] [--inputs FILE.npz]
                   [--backend NAME]

It imports no backend itself: it finds the installed ones and runs each one's work in
a child process with `KERAS_BACKEND` set. Exits with status 1 when any difference
exceeds its tolerance (or our layer failed), 2 on a usage error (one line naming the
file, module or input; nothing is written), 0 otherwise.
"""

import argparse
import json
import math
import os
import statistics
import sys

from keras_mha import compare
from keras_mha.compare import known
from keras_mha.user_model import UsageError

CLI_EXTRA = "pip install 'keras-mha[cli]'"


def main(argv=None):
    """Entry point of the `keras-mha` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        _check_cli_dependencies(args)
        if args.command == "swap":
            return _swap(args)
        if args.model is not None:
            return _compare_model(args, parser)
        return _compare(args, parser)
    except UsageError as error:
        print(f"keras-mha {args.command}: error: {error}", file=sys.stderr)
        return 2


def _check_cli_dependencies(args):
    import importlib.util

    needed = ["matplotlib"] if getattr(args, "plot", None) else []
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"needs {' and '.join(missing)}, not installed: {CLI_EXTRA}")


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-mha",
        description="keras_mha.MultiHeadAttention against keras.layers.MultiHeadAttention.",
    )
    commands = parser.add_subparsers(dest="command")
    cmd = commands.add_parser(
        "compare",
        help="parity and speed against the built-in layer, per backend",
        description=(
            "Builds ours and the built-in on each case, copies the weights, reports the "
            "largest differences of outputs, scores and input gradients, and the median "
            "predict/train step times. Each backend runs in its own process."
        ),
    )
    cmd.add_argument("--backend", choices=("all",) + compare.BACKENDS, default="all")
    cmd.add_argument("--quick", action="store_true", help="small shapes (about a minute)")
    cmd.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help=f"timed calls per step (default {compare.DEFAULT_REPEATS}, "
        f"{compare.QUICK_REPEATS} with --quick)",
    )
    cmd.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    cmd.add_argument("--plot", metavar="PATH", help="write a PNG of the speed ratios")
    names = ",".join(case.name for case in compare.DEFAULT_CASES)
    cmd.add_argument("--cases", metavar="NAME,...", help=f"a subset of: {names}")
    cmd.add_argument(
        "--model",
        metavar="IN.keras",
        help="compare on your own model instead: the file as it is and swapped "
        "(outputs, weight gradients, time and peak memory)",
    )
    _user_model_arguments(cmd)
    cmd.add_argument(
        "--no-memory",
        action="store_true",
        help="with --model: skip the peak-memory runs (two more processes per backend)",
    )
    # Testing aid: noise on our copied weights plants a mismatch.
    cmd.add_argument("--perturb", type=float, default=0.0, help=argparse.SUPPRESS)

    swap = commands.add_parser(
        "swap",
        help="write a copy of your model with keras_mha's attention in place of the built-in",
        description=(
            "Loads IN.keras, swaps every keras.layers.MultiHeadAttention (at the top level "
            "or inside your layers) for keras_mha.MultiHeadAttention with the same "
            "configuration and weights, checks the outputs on synthesized inputs (or "
            "--inputs) and writes OUT.keras, which loads with `import keras_mha` (also "
            "with safe_mode=True). Exits with 1 when an output differs by more than "
            f"{compare.ATOL:g}."
        ),
    )
    swap.add_argument("input", metavar="IN.keras")
    swap.add_argument("output", metavar="OUT.keras")
    _user_model_arguments(swap)
    swap.add_argument(
        "--backend",
        choices=compare.BACKENDS,
        default=None,
        help="the backend that runs it (default: $KERAS_BACKEND, else the first installed)",
    )
    swap.add_argument("--perturb", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


def _user_model_arguments(parser):
    parser.add_argument(
        "--import",
        dest="imports",
        metavar="MODULE",
        action="append",
        default=[],
        help="a module to import first: the one that registers your custom layers "
        "(repeat for several)",
    )
    parser.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="the model's inputs, by input name or in order (default: synthesized from "
        "its input specs: floats standard normal, ints in [1, 10))",
    )


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"Received an invalid value for argument `--repeats`, expected a positive "
            f"integer. Received: repeats={text}"
        )
    return value


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # logs and pipes: keep each table row on one line
    return console


def _progress(console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def _backends(choice, console):
    installed = compare.installed_backends()
    if not installed:
        raise UsageError(
            "no backend installed: pip install 'keras-mha[jax]' (or tensorflow, torch)"
        )
    if choice == "all":
        for missing in sorted(set(compare.BACKENDS) - set(installed)):
            console.print(f"[yellow]{missing}: not installed, skipped[/yellow]")
        return installed
    if choice not in installed:
        raise UsageError(f"--backend {choice}: not installed")
    return (choice,)


def _compare(args, parser):
    if args.imports or args.inputs or args.no_memory:
        parser.error("--import, --inputs and --no-memory go with --model")
    console = _console()
    try:
        names = None if args.cases is None else [n for n in args.cases.split(",") if n]
        cases = compare.get_cases(names)
    except ValueError as error:
        parser.error(str(error))
    backends = _backends(args.backend, console)

    records = []
    with _progress(console) as progress:
        task = progress.add_task("starting", total=len(backends) * len(cases))
        for backend in backends:
            progress.update(task, description=f"{backend}: starting worker")

            def on_record(record, backend=backend):
                progress.update(task, advance=1, description=f"{backend}: {record['case']} done")

            records.extend(
                compare.run_backend(
                    backend,
                    cases,
                    quick=args.quick,
                    repeats=args.repeats,
                    perturb=args.perturb,
                    on_record=on_record,
                )
            )

    return _report(console, backends, records, args)


def _report(console, backends, records, args):
    for backend in backends:
        rows = [r for r in records if r["backend"] == backend]
        console.print(render_table(backend, rows))
        console.print(verdict(backend, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
        console.print(f"records written to {args.json}")
    if args.plot:
        plot_ratios(records, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0 if all(r["passed"] for r in records) else 1


def _compare_model(args, parser):
    if args.cases is not None or args.quick:
        parser.error("--cases and --quick go with the built-in cases, not with --model")
    _check_readable(args.model, args.inputs)
    _check_writable(args.json, args.plot)
    console = _console()
    backends = _backends(args.backend, console)
    records = []
    with _progress(console) as progress:
        task = progress.add_task("starting", total=len(backends))
        for backend in backends:
            progress.update(task, description=f"{backend}: loading, swapping, comparing")

            def on_record(record, backend=backend):
                progress.update(task, advance=1, description=f"{backend}: done")

            records.extend(
                compare.run_model_backend(
                    backend,
                    args.model,
                    imports=args.imports,
                    inputs=args.inputs,
                    repeats=args.repeats,
                    memory=not args.no_memory,
                    perturb=args.perturb,
                    on_record=on_record,
                )
            )
    layers = next((r["layers"] for r in records if r.get("layers")), None)
    if layers:
        console.print(render_layers(layers))
        model_notes = next((r["model_notes"] for r in records if r.get("model_notes")), ())
        _print_notes(console, layers, model_notes)
    return _report(console, backends, records, args)


def _swap(args):
    _check_readable(args.input, args.inputs)
    backend = args.backend
    installed = compare.installed_backends()
    if backend is None:
        preferred = os.environ.get("KERAS_BACKEND")
        backend = preferred if preferred in installed else (installed or [None])[0]
    if backend is None:
        raise UsageError(
            "no backend installed: pip install 'keras-mha[jax]' (or tensorflow, torch)"
        )
    if backend not in installed:
        raise UsageError(f"--backend {backend}: not installed")
    console = _console()
    with console.status(f"{backend}: loading, swapping, checking the outputs"):
        result = compare.run_swap(
            backend,
            args.input,
            args.output,
            imports=args.imports,
            inputs=args.inputs,
            perturb=args.perturb,
        )
    console.print(render_layers(result["layers"], title=f"{args.input} -> {args.output}"))
    _print_notes(console, result["layers"], result.get("model_notes") or ())
    shapes = ", ".join(f"{k} {tuple(v)}" for k, v in result["inputs"].items())
    for name, case in result["input_cases"].items():
        diff = (
            f"{name} inputs: largest output difference {case['max_abs_diff']:.1e}, "
            f"gradient {case['grad_max_abs_diff']:.1e} on {shapes} ({backend})"
            + (", output masks differ" if case.get("masks_match") is False else "")
        )
        if case.get("classification"):
            line = known.describe(name, case["classification"])
            console.print(f"[yellow]KNOWN[/yellow]: {line}", soft_wrap=True)
        elif case["passed"]:
            console.print(f"[green]PASS[/green]: {diff}, within {result['tolerance']:g}")
        else:
            console.print(f"[red]FAIL[/red]: {diff}, above {result['tolerance']:g}")
            if "reference_backend" in case and case["reference_backend"] is None:
                console.print(
                    "  no other backend installed to check it against: torch's built-in "
                    f"is wrong in gradients through rows with no key ({known.DOCS})",
                    soft_wrap=True,
                )
    console.print(f"written to {result['out']}")
    return 0 if result["passed"] else 1


def _print_notes(console, rows, model_notes=()):
    """One line per difference between a moved keras-hub class and ours (its entry's
    notes in `keras_mha.hub`), once per class; then one per way the check ran the model
    other than by its call (`model_notes`)."""
    for note in model_notes:
        console.print(f"[cyan]NOTE[/cyan]: {note}", soft_wrap=True)
    seen = set()
    for row in rows:
        for note in row.get("notes") or ():
            if (row["before"], note) not in seen:
                seen.add((row["before"], note))
                cls = row["before"].rpartition(".")[2]
                console.print(f"[cyan]NOTE[/cyan]: {cls}: {note}", soft_wrap=True)


def _check_readable(*paths):
    for path in paths:
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{path}: no such file")


def _check_writable(*paths):
    for path in paths:
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"{path}: no such folder")


def render_layers(rows, title="attention layers"):
    """A rich `Table` of a swap report: path, before -> after, configuration."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("layer", "was", "now", "config"):
        table.add_column(column, no_wrap=column != "config")
    for row in rows:
        now = row["after"]
        if row["status"] == "left on the built-in":
            now = f"[yellow]left: {row['reason']}[/yellow]"
        table.add_row(row["path"], row["before"], now, row["config"])
    return table


def render_table(backend, records):
    """A rich `Table` of one backend's records."""
    from rich.table import Table

    table = Table(
        title=f"{backend}: keras_mha vs keras.layers.MultiHeadAttention "
        "(max |diff|; median ms; ratio = ours / built-in)"
    )
    table.add_column("case", no_wrap=True)
    for column in ("out diff", "scores diff", "grad diff"):
        table.add_column(column, justify="right", no_wrap=True)
    for column in ("predict ours", "built-in", "ratio", "train ours", "built-in", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    memory = any(r.get("ours_peak_mib") or r.get("builtin_peak_mib") for r in records)
    if memory:
        for column in ("peak MiB ours", "built-in", "ratio"):
            table.add_column(column, justify="right", no_wrap=True)
    table.add_column("status")
    notes = []
    for r in records:
        if r["ours_error"]:
            status = f"[red]FAIL: {r['ours_error']}[/red]"
        elif not r["passed"]:
            differed = compare.failed_input_cases(r)
            where = f" on {' and '.join(differed)} inputs" if differed else ""
            status = f"[red]FAIL: above tolerance{where}[/red]"
        elif r["builtin_error"]:
            notes.append(f"{r['case']}: the built-in failed: {r['builtin_error']}")
            status = "[yellow]ok, built-in failed[/yellow]"
        elif r.get("classification"):
            status = "[yellow]ok, built-in wrong (known)[/yellow]"
        else:
            status = "[green]ok[/green]"
        for name, case in (r.get("input_cases") or {}).items():
            if case.get("classification"):
                notes.append(f"{r['case']}, known: {known.describe(name, case['classification'])}")
                continue
            notes.append(
                f"{r['case']}, {name} inputs: output diff {_sci(case['max_abs_diff'])}, "
                f"grad diff {_sci(case['grad_max_abs_diff'])}"
                + (", output masks differ" if case.get("masks_match") is False else "")
                + ("" if case["passed"] else " [red](differs)[/red]")
            )
        table.add_row(
            r["case"],
            _sci(r["max_abs_diff"]),
            _sci(r["scores_max_abs_diff"]),
            _sci(r["grad_max_abs_diff"]),
            _ms(r["ours_predict_ms"]),
            _ms(r["builtin_predict_ms"]),
            _ratio(r["predict_ratio"]),
            _ms(r["ours_train_ms"]),
            _ms(r["builtin_train_ms"]),
            _ratio(r["train_ratio"]),
            *(
                (
                    _mib(r.get("ours_peak_mib")),
                    _mib(r.get("builtin_peak_mib")),
                    _ratio(r.get("peak_ratio")),
                )
                if memory
                else ()
            ),
            status,
        )
    if notes:
        table.caption = "\n".join(notes)
    return table


def verdict(backend, records):
    """One line: pass or fail, how many cases, and the median speed ratios."""
    failed = [
        r["case"] + "".join(f" ({name} inputs)" for name in compare.failed_input_cases(r))
        for r in records
        if not r["passed"]
    ]
    compared = sum(r["max_abs_diff"] is not None for r in records)
    speed = []
    for step in ("predict", "train", "peak"):
        ratios = [r[f"{step}_ratio"] for r in records if r.get(f"{step}_ratio")]
        if ratios:
            what = "peak memory" if step == "peak" else step
            speed.append(f"{what} {statistics.median(ratios):.2f}x")
    speed = ", median ours/built-in: " + ", ".join(speed) if speed else ""
    if failed:
        return f"[red]{backend}: FAIL[/red] on {', '.join(failed)}{speed}"
    classified = [r["case"] for r in records if r.get("classification")]
    within = (
        f"within {compare.ATOL:g} but where the built-in is documented wrong "
        f"({', '.join(classified)}: {known.DOCS})"
        if classified
        else f"within {compare.ATOL:g}"
    )
    return (
        f"[green]{backend}: PASS[/green] {compared}/{len(records)} cases compared, all "
        f"{within}{speed}"
    )


def plot_ratios(records, path):
    """Writes a PNG that answers "is it the same, and is it faster", one panel per backend.

    Bars: the median time ratio ours / built-in per case (predict, train step, and peak
    memory where measured); whiskers: the first and third quartiles of the timed rounds'
    ratios. Under each case: the largest output and gradient difference and the verdict
    (same, differs, the built-in's documented difference, the built-in failed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.transforms as transforms

    backends = list(dict.fromkeys(r["backend"] for r in records))
    most = max(sum(r["backend"] == b for r in records) for b in backends)
    fig, axes = plt.subplots(
        len(backends),
        1,
        figsize=(max(7.0, 1.55 * most + 2.5), 3.6 * max(1, len(backends))),
        squeeze=False,
    )
    steps = ["predict", "train"]
    if any(r.get("peak_ratio") for r in records):
        steps.append("peak")
    width = 0.8 / len(steps)
    for ax, backend in zip(axes[:, 0], backends):
        rows = [r for r in records if r["backend"] == backend]
        xs = list(range(len(rows)))
        top = 1.15
        for i, step in enumerate(steps):
            offset = (i - (len(steps) - 1) / 2) * width
            values = [r.get(f"{step}_ratio") or math.nan for r in rows]
            spread = [r.get(f"{step}_ratio_quartiles") for r in rows]
            label = "peak memory" if step == "peak" else f"{step} (median)"
            at = [x + offset for x in xs]
            ax.bar(at, values, width=width, label=label)
            # The whiskers span the rounds' quartiles wherever the bar (the ratio of the
            # two medians) falls: drawn from their middle, not from the bar's top.
            spans = [(a, q) for a, q in zip(at, spread) if q]
            if spans:
                ax.errorbar(
                    [a for a, _ in spans],
                    [(q[0] + q[1]) / 2 for _, q in spans],
                    yerr=[(q[1] - q[0]) / 2 for _, q in spans],
                    fmt="none",
                    elinewidth=1,
                    capsize=2.5,
                    ecolor="0.2",
                )
            for x, v, q in zip(xs, values, spread):
                if not math.isnan(v):
                    above = max(v, q[1]) if q else v
                    ax.text(x + offset, above, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5)
                    top = max(top, above * 1.15)
        ax.set_ylim(0, top)
        middle = transforms.blended_transform_factory(ax.transData, ax.transAxes)
        for x, r in zip(xs, rows):
            if r.get("predict_ratio") is None and r.get("train_ratio") is None:
                ax.text(
                    x,
                    0.5,
                    "built-in\nfailed:\nno ratio",
                    transform=middle,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="0.3",
                    bbox={"boxstyle": "round", "facecolor": "0.95", "edgecolor": "0.7"},
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        labels = [_parity_label(r) for r in rows]
        ax.set_xticks(xs, [text for text, _ in labels], fontsize=7.5)
        for tick, (_, color) in zip(ax.get_xticklabels(), labels):
            tick.set_color(color)
        ax.set_ylabel("time ours / built-in")
        compared = [r for r in rows if r.get("max_abs_diff") is not None]
        same = sum(bool(r.get("passed")) for r in compared)
        ax.set_title(
            f"{backend}: {same}/{len(compared)} compared same within {compare.ATOL:g}"
            f"{_not_compared(len(rows) - len(compared))}\nbars: ours / "
            "built-in, below 1 ours faster; whiskers: quartiles of the timed rounds",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parity_label(record):
    """The x label of one case: its name, its largest differences, its verdict, and the
    verdict's color."""
    case, get = record["case"], record.get
    diffs = f"out {_short(get('max_abs_diff'))}, grad {_short(get('grad_max_abs_diff'))}"
    if get("ours_error"):
        return f"{case}\nours failed", "red"
    if get("passed") is False:
        return f"{case}\n{diffs}\nDIFFERS", "red"
    if get("classification"):
        return f"{case}\n{diffs}\nsame; built-in's grads\nwrong (masks guide)", "darkorange"
    if get("builtin_error"):
        return f"{case}\nbuilt-in failed\n(not compared)", "0.35"
    if get("max_abs_diff") is None:
        return f"{case}\nnot compared", "0.35"
    return f"{case}\n{diffs}\nsame", "#1a7f37"


def _not_compared(count):
    return f", {count} not compared (a side failed: its label says which)" if count else ""


def _short(value):
    return "—" if value is None else "0" if value == 0 else f"{value:.0e}"


def _sci(value):
    return "—" if value is None else f"{value:.1e}"


def _ms(value):
    return "—" if value is None else f"{value:.2f}"


def _mib(value):
    return "—" if value is None else f"{value:.0f}"


def _ratio(value):
    return "—" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
