"""The `keras-mha` command line, a thin layer over `keras_mha.compare`.

    keras-mha compare [--backend {all,tensorflow,jax,torch}] [--quick] [--repeats N]
                      [--json PATH] [--plot PATH] [--cases NAME,...]

Exits with status 1 when any difference exceeds its tolerance (or our layer failed),
2 on a usage error, 0 otherwise.
"""

import argparse
import json
import math
import statistics
import sys

from keras_mha import compare


def main(argv=None):
    """Entry point of the `keras-mha` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "compare":
        parser.print_help()
        return 2
    return _compare(args, parser)


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
    # Testing aid: noise on our copied weights plants a mismatch.
    cmd.add_argument("--perturb", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


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


def _compare(args, parser):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: keep each table row on one line
    try:
        names = None if args.cases is None else [n for n in args.cases.split(",") if n]
        cases = compare.get_cases(names)
    except ValueError as error:
        parser.error(str(error))
    installed = compare.installed_backends()
    if args.backend == "all":
        backends = installed
        for missing in sorted(set(compare.BACKENDS) - set(installed)):
            console.print(f"[yellow]{missing}: not installed, skipped[/yellow]")
    else:
        backends = (args.backend,)

    records = []
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
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
    table.add_column("status")
    notes = []
    for r in records:
        if r["ours_error"]:
            status = f"[red]FAIL: {r['ours_error']}[/red]"
        elif not r["passed"]:
            status = "[red]FAIL: above tolerance[/red]"
        elif r["builtin_error"]:
            notes.append(f"{r['case']}: the built-in failed: {r['builtin_error']}")
            status = "[yellow]ok, built-in failed[/yellow]"
        else:
            status = "[green]ok[/green]"
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
            status,
        )
    if notes:
        table.caption = "\n".join(notes)
    return table


def verdict(backend, records):
    """One line: pass or fail, how many cases, and the median speed ratios."""
    failed = [r["case"] for r in records if not r["passed"]]
    compared = sum(r["max_abs_diff"] is not None for r in records)
    speed = []
    for step in ("predict", "train"):
        ratios = [r[f"{step}_ratio"] for r in records if r[f"{step}_ratio"]]
        if ratios:
            speed.append(f"{step} {statistics.median(ratios):.2f}x")
    speed = ", median time ours/built-in: " + ", ".join(speed) if speed else ""
    if failed:
        return f"[red]{backend}: FAIL[/red] on {', '.join(failed)}{speed}"
    return (
        f"[green]{backend}: PASS[/green] {compared}/{len(records)} cases compared, all "
        f"within {compare.ATOL:g}{speed}"
    )


def plot_ratios(records, path):
    """Writes a PNG: ours/built-in time per case, forward and train, one panel per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(r["backend"] for r in records))
    fig, axes = plt.subplots(
        len(backends), 1, figsize=(9, 2.8 * max(1, len(backends))), squeeze=False
    )
    for ax, backend in zip(axes[:, 0], backends):
        rows = [r for r in records if r["backend"] == backend]
        xs = range(len(rows))
        for offset, step in ((-0.2, "predict"), (0.2, "train")):
            values = [r[f"{step}_ratio"] or math.nan for r in rows]
            ax.bar([x + offset for x in xs], values, width=0.4, label=step)
        for x, r in zip(xs, rows):
            if r["predict_ratio"] is None and r["train_ratio"] is None:
                ax.text(x, 1.0, "built-in\nfailed", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_xticks(list(xs), [r["case"] for r in rows], fontsize=8)
        ax.set_ylabel("ours / built-in")
        ax.set_title(f"{backend} (below 1: ours faster; no bar: built-in failed)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sci(value):
    return "—" if value is None else f"{value:.1e}"


def _ms(value):
    return "—" if value is None else f"{value:.2f}"


def _ratio(value):
    return "—" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
