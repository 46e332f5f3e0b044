"""The fixed cost of one ``lightning-precision compare`` run: where the time goes before the first training step, per
process, and the whole run against its training steps.

Each run is the real command (``cli.main(["compare", ...])``) in a fresh interpreter, with marks taken as it goes: the
parent's imports, its measuring of the batch (the recipe built, the FLOPs counted), and in each precision's process its
start, its imports, its recipe build, its Trainer set-up (the fit up to its first batch) and its first step; then the
end of the runs and the report. Marks come from wrapping functions that the command has had all along
(``runner.run_child``, ``Recipe.build``, ``Trainer.__init__``/``fit``, ``compare.measure_batch``,
``compare.model_flops_per_step``), so the same script times an older checkout: ``--before DIR`` (e.g. made with
``git archive <commit> | tar -x -C DIR``) runs it beside this checkout, alternated, in paired rounds.

    python benchmarks/compare_overhead.py --threads 1 --rounds 5 --before /tmp/before

Fixed overhead: the run's wall time less the time its precisions spent in training steps (they take turns, so their
step times add up), i.e. what a run costs beyond training. Wall time, not CPU time: a run is several processes, and the
fork server's and its children's CPU time is not reaped by the command's process (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKS = "COMPARE_OVERHEAD_MARKS"  # the file each process appends its marks to
T0 = "COMPARE_OVERHEAD_T0"  # the time.time() at which the benchmark launched the command


def _mark(who: str, what: str) -> None:
    with open(os.environ[MARKS], "a") as f:
        f.write(json.dumps([who, what, time.time() - float(os.environ[T0])]) + "\n")


def _timed_child(conn, recipe, precision, args, *rest) -> None:
    """``runner.run_child`` with marks: what a precision's process does, phase by phase."""
    _mark(precision, "entered")
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback

    from lightning_precision.cli.compare import child
    from lightning_precision.cli.recipes import Recipe

    _mark(precision, "imported")
    build, init, fit = Recipe.build, Trainer.__init__, Trainer.fit

    class Steps(Callback):
        def on_train_batch_start(self, *a) -> None:
            _mark(precision, "step start")

        def on_train_batch_end(self, *a) -> None:
            _mark(precision, "step end")

    def timed_build(self, *a, **k):
        _mark(precision, "build start")
        try:
            return build(self, *a, **k)
        finally:
            _mark(precision, "build end")

    def timed_init(self, *a, **k):
        k["callbacks"] = [*(k.get("callbacks") or []), Steps()]
        init(self, *a, **k)

    def timed_fit(self, *a, **k):
        _mark(precision, "fit start")
        return fit(self, *a, **k)

    Recipe.build, Trainer.__init__, Trainer.fit = timed_build, timed_init, timed_fit  # type: ignore[method-assign]
    child.run_child(conn, recipe, precision, args, *rest)
    _mark(precision, "done")


def _wrap(module, name: str, who: str = "parent") -> None:
    real = getattr(module, name)

    def timed(*a, **k):
        _mark(who, f"{name} start")
        try:
            return real(*a, **k)
        finally:
            _mark(who, f"{name} end")

    setattr(module, name, timed)


def _driver(argv: list[str]) -> int:
    """The command, marked: run in a fresh interpreter by ``_run``."""
    _mark("parent", "interpreter")
    import lightning_precision.cli as cli
    from lightning_precision.cli.compare import main as compare
    from lightning_precision.cli.compare import runner

    _mark("parent", "imported")
    runner.run_child = _timed_child  # type: ignore[assignment]
    _wrap(compare, "measure_batch")
    _wrap(compare, "model_flops_per_step")
    _wrap(runner, "run_all")
    code = cli.main(["compare", *argv])
    _mark("parent", "returned")
    return code


def _run(root: Path, argv: list[str], threads: int) -> dict[str, float]:
    """One run of the command from checkout ``root``: its phases in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        marks = Path(tmp) / "marks.jsonl"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(HERE)]), MARKS: str(marks),
               "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        start = time.time()
        env[T0] = repr(start)
        driver = "import sys, compare_overhead as b; sys.exit(b._driver(sys.argv[1:]))"
        done = subprocess.run([sys.executable, "-c", driver, *argv, "--out", str(Path(tmp) / "report")], env=env,
                              capture_output=True, text=True, cwd=tmp, timeout=1800)
        total = time.time() - start
        if done.returncode != 0:
            raise RuntimeError(f"the run from {root} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        rows = [json.loads(line) for line in marks.read_text().splitlines()]
    at: dict[tuple[str, str], list[float]] = {}
    for who, what, t in rows:
        at.setdefault((who, what), []).append(t)
    children = sorted({who for who, _, _ in rows if who != "parent"})

    def first(who: str, what: str) -> float:
        return at[who, what][0]

    steps = sum(e - s for c in children for s, e in zip(at[c, "step start"], at[c, "step end"], strict=True))
    phases = {
        "parent: interpreter + imports": first("parent", "imported"),
        "parent: recipe build (measuring)": first("parent", "model_flops_per_step start")
        - first("parent", "measure_batch start"),
        "parent: FLOP count": first("parent", "model_flops_per_step end")
        - first("parent", "model_flops_per_step start"),
    }
    per_child = {
        "child: start (process up)": [first(c, "entered") - first("parent", "run_all start") for c in children],
        "child: imports": [first(c, "imported") - first(c, "entered") for c in children],
        "child: waits before its build (imports, unpickling)": [first(c, "build start") - first(c, "imported")
                                                                 for c in children],
        "child: recipe build": [first(c, "build end") - first(c, "build start") for c in children],
        "child: Trainer set-up (to its first batch)": [first(c, "step start") - first(c, "build end")
                                                       for c in children],
        "child: first step": [first(c, "step end") - first(c, "step start") for c in children],
    }
    phases.update({name: statistics.fmean(values) for name, values in per_child.items()})
    phases.update({
        "to the first step's end": min(first(c, "step end") for c in children),
        "after the runs: processes ended": first("parent", "run_all end") - max(first(c, "done") for c in children),
        "after the runs: report written": first("parent", "returned") - first("parent", "run_all end"),
        "after the runs: the command's exit": total - first("parent", "returned"),
        "training steps (all precisions)": steps,
        "total": total,
        "fixed overhead (total - steps)": total - steps,
    })
    return phases


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None, help="an older checkout, run beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipe", default="distilbert", help="default: the embedded default's")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="default: a CPU's default")
    parser.add_argument("--steps", type=int, default=2, help="few: the run is mostly its fixed cost")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (compare's --accelerator)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    command = ["--recipe", args.recipe, "--precisions", args.precisions, "--steps", str(args.steps),
               "--val-batches", "1", "--accelerator", args.device]
    variants = {"after": HERE.parent, **({"before": args.before.resolve()} if args.before else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))  # alternated: drift hits both alike
        for name in order:
            results[name].append(_run(variants[name], command, args.threads))
            print(f"round {r + 1} {name}: total {results[name][-1]['total']:.1f} s, load {os.getloadavg()[0]:.2f}",
                  flush=True)
    print(f"\ncompare {' '.join(command)}; {args.threads} thread(s) a process; {args.rounds} rounds; median [IQR], s;"
          f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    names = list(results[next(iter(variants))][0])
    header = "| phase | " + " | ".join(variants) + (" | after / before |" if len(variants) == 2 else " |")
    print(header + "\n|" + "---|" * (header.count("|") - 1))
    for phase in names:
        cells = []
        for name in variants:
            q1, q2, q3 = _quartiles([run[phase] for run in results[name]])
            cells.append(f"{q2:.2f} [{q1:.2f}, {q3:.2f}]")
        if len(variants) == 2 and phase in ("total", "fixed overhead (total - steps)", "to the first step's end"):
            ratios = [a[phase] / b[phase] for a, b in zip(results["after"], results["before"], strict=True)]
            q1, q2, q3 = _quartiles(ratios)
            cells.append(f"{q2:.2f} [{q1:.2f}, {q3:.2f}] (paired)")
        elif len(variants) == 2:
            cells.append("")
        print(f"| {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
