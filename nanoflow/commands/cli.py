"""Command-line front ends. Thin: parse arguments, call the library, turn known errors into exit codes."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from nanoflow import console
from nanoflow.config import ConfigError, load_config
from nanoflow.errors import (
    EXIT_BAD_INPUT,
    EXIT_BUG,
    EXIT_DONE,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    INTERRUPTED,
    MissingExtraError,
    NanoflowError,
    not_installed,
    without_credentials,
)
from nanoflow.parallel import threads
from nanoflow.training import signals

# What a command says as it works (and its closing summary line) is a message, through logging; what a command
# is asked to produce — the --plan table, bin/report's table, the converted TOML — is printed, for piping.
log = logging.getLogger(__name__)


def exit_process(code: int) -> None:
    """sys.exit(code); in a torchrun worker, nanoflow.parallel.mesh.exit_process (which skips a teardown that can abort).

    While a background checkpoint write is still running (a second Ctrl-C cut it), the interpreter's teardown
    is skipped too: the write's daemon thread, stopped there in the middle of torch's C++ code, can abort the
    process ("terminate called without an active exception", status 134). Nothing of that write is committed
    (the commit is the main thread's), and the next commit clears its temporaries."""
    async_save = sys.modules.get("nanoflow.checkpoint.async_save")
    if async_save is not None and async_save.writing():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    parallel = sys.modules.get("nanoflow.parallel.mesh")  # never imported for --plan or a config error: nothing to skip
    if parallel is not None:
        parallel.exit_process(code)
    sys.exit(code)


def guarded(work: Callable[[], int], where: str | None = None) -> int:
    """Run a front end's work and return its exit status. A NanoflowError becomes its message on
    stderr, prefixed with `where` (the file the command was given) unless the message names it
    already, and the error's exit_status; a dependency that is not installed, one line and 2; Ctrl-C, one line
    and 130; a closed pipe on stdout, a quiet 0. Never a traceback for these."""
    try:
        with console.installed():
            return work()
    except NanoflowError as e:
        message = str(e)
        # A missing package is the installation's, not the given file's: no file named before it.
        if where and not isinstance(e, MissingExtraError) and not message.startswith((where, str(Path(where)))):
            message = f"{where}: {message}"
        print(f"error: {without_credentials(message)}", file=sys.stderr)
        return e.exit_status
    except ModuleNotFoundError as e:   # a dependency imported on first use (torch, datasets, ...) is not installed
        if e.name is None or e.name.partition(".")[0] == "nanoflow":
            raise  # a module of nanoflow's own that is not there: a bug, with its traceback
        print(f"error: {not_installed(e.name, sys.executable)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # at start-up, or a second Ctrl-C in training: a save it cuts never commits
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:   # the reader stopped reading (`| head`): as a C tool ends on SIGPIPE, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush raises nothing more
        return 0
    except signals.StoppedAtStartUp as e:  # SIGTERM / SIGUSR1 before the first step: nothing to save, requeue
        print(f"stopped by {e.name} during start-up, before any step was trained: nothing to save; the last "
              "committed checkpoint (if any) is untouched; run the same command again to resume", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as e:
        lost = _lost_peer(e)
        if lost is None:
            raise
        print(f"error: {lost}", file=sys.stderr)
        return lost.exit_status


def _lost_peer(error: Exception):
    """A collective whose peer went away (nanoflow.parallel.mesh.lost_peer), in a process that joined a group: an
    ordinary event under torchrun (a node lost), never a bug's traceback."""
    parallel = sys.modules.get("nanoflow.parallel.mesh")   # not imported: no collective was made
    return None if parallel is None else parallel.lost_peer(error)


# What every --set help says of a path: a value is read as the file's own would be.
SET_PATHS = ("A path is relative to the config file, as the file's own paths are (not to the working directory): "
             "--set 'checkpoints.checkpoints_path=\"../runs/x\"' next to schedules/tiny.toml is runs/x.")


def program(script: str) -> str:
    """The name a command calls itself in --help: the installed entry point's (nanoflow-train) when it was run by
    that name, else its script's (bin/train)."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return invoked if invoked.startswith("nanoflow-") else script


def train_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/train"),
        description="Train a Llama-style model through the data stages of a TOML curriculum.",
        epilog=f"Example: {program('bin/train')} schedules/curriculum.toml --set tokens.train_steps=50 --plan")
    parser.add_argument("config", help="the run's TOML config (paths inside it are relative to it)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config key; the value is TOML (a bare word is a string). {SET_PATHS} "
                             "Stages by name or index: data_stages.sft.sequence_length=64. Repeatable.")
    parser.add_argument("--plan", action="store_true", help="print the stage plan and exit without training")
    parser.add_argument("--plot", metavar="PNG", help="with --plan: also draw it (stages, LR, global batch, sequence "
                                                      "length, source shares over the steps) into this PNG")
    parser.add_argument("--fresh", action="store_true",
                        help="start from step 1 even if checkpoints_path or resume_checkpoint_path holds a checkpoint "
                             "(a step is replaced when the new run commits its own; the old run's later steps "
                             "rank after the new run's, and go first under checkpoints.keep)")
    parser.add_argument("--until-step", "--stop-at", dest="until_step", type=_step_number, metavar="N",
                        help="stop, and save, after step N without changing the schedule (train_steps, the LR); "
                             "exit status 0 once step N is done. Run again without it, or with a later N, to go on")
    args = parser.parse_args(argv)
    if args.plot is not None and not args.plan:
        parser.error("--plot draws the plan: give --plan too")
    return guarded(lambda: _train_or_plan(args), where=args.config)


def _step_number(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a step number (1 or more)")
    return int(text)


def _train_or_plan(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    from nanoflow.observe.wandb_log import check_installed, check_login
    check_installed(config)   # [logging.wandb] without the package: said now, for --plan too, not at the first step
    check_login(config)       # ... or online without a W&B login
    if args.until_step is not None and args.until_step > config.tokens.train_steps:
        raise ConfigError(f"--until-step {args.until_step} is after tokens.train_steps = {config.tokens.train_steps}, "
                          "where the run ends anyway (drop it, or raise train_steps: that changes the LR schedule)")
    if args.plan:
        from nanoflow.commands.plan import render_plan
        from nanoflow.data.probe import probe_data
        from nanoflow.run import open_run
        if args.plot is not None:
            from nanoflow.commands.report import check_figure_path
            check_figure_path(args.plot, "--plot")   # before the plan's checks, which open the data
        stages, evals = len(config.data_stages), len(config.evaluation.datasets) if config.evaluation else 0
        sources = f"{stages} stage{'s' * (stages != 1)}" + (f" and {evals} eval set{'s' * (evals != 1)}" if evals else "")
        with console.routed(sys.stderr):   # stdout is the plan's; a line before the silence of opening the data
            log.info(f"--plan: opening the tokenizer and the data of {sources}, as training would (a large source "
                     "takes a while)")
        run = open_run(config, join=False)   # the checks a training run would pass first, in this process alone
        with console.routed(sys.stderr):   # a line per source opened, beside the plan on stdout (for piping)
            probe_data(run.config, run.tokenizer, run.schedule)   # what the run's start-up would stop on
        print(render_plan(run))
        if args.until_step is not None:
            print(f"stops after step {args.until_step} (--until-step)")
        if args.plot is not None:
            from nanoflow.commands.plan_plot import write_plan_plot
            print(f"\nwrote {write_plan_plot(run, args.plot)}")
        return EXIT_DONE
    from nanoflow.parallel.mesh import shutdown
    from nanoflow.training.loop import open_training  # the training machinery, once the config is known to be good
    try:
        with open_training(config, fresh=args.fresh, until_step=args.until_step) as training:
            state = training.run_loop()
    finally:
        shutdown()
    # Short of the step asked for only when a signal stopped it (after saving): requeue, rerun to resume. A stop
    # at --until-step is what was asked for: 0.
    goal = state.schedule.train_steps if args.until_step is None else args.until_step
    if state.step >= goal:
        signals.ignore_from_now()  # finished, its last checkpoint committed: 0, whatever signal comes now
        return EXIT_DONE
    return EXIT_STOPPED


def verify_resume_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/verify-resume"),
        description="Train CONFIG straight, then again with kill -9 at random moments (mid-step and mid-save) and "
                    "a resume after each; PASS if both end bit-identical (weights and optimizer moments).")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config key, as in bin/train. {SET_PATHS} Repeatable.")
    parser.add_argument("--kills", type=int, default=6, help="how many times to kill the run (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--workdir", help="where the two runs go (default: a temporary folder, removed after)")
    args = parser.parse_args(argv)
    return guarded(lambda: _verify_resume(args), where=args.config)


def _verify_resume(args: argparse.Namespace) -> int:
    load_config(args.config, args.overrides)  # fail fast, with the usual message, on a bad config
    import tempfile
    if threads.chosen():   # one count for both runs, which its bin/train processes inherit: both start fresh
        count, line = threads.choose(None)
        os.environ[threads.ENV] = str(count)
        log.info(f"{line}; both runs train with it")

    from nanoflow.commands.verify import verify_resume
    with tempfile.TemporaryDirectory(prefix="verify-resume-") as temporary:
        workdir = Path(args.workdir or temporary)
        ok = verify_resume(args.config, args.overrides, workdir, kills=args.kills, seed=args.seed)
    return EXIT_DONE if ok else EXIT_BUG


def prepare_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/prepare"),
        description="Tokenize text into a token folder (the *.ds layout HF datatrove writes and nanotron's Nanoset "
                    "reads) for a stage's dataset_folder. Resumable: rerun the same command after a crash.",
        epilog=f"Example: {program('bin/prepare')} corpus/*.txt docs.jsonl --output data/tokens --tokenizer bytes")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files (one document each), jsonl/json/csv/parquet/arrow files (one per row), a "
                             "folder saved with Dataset.save_to_disk, or a hub dataset name; read in this order")
    parser.add_argument("--output", required=True, metavar="FOLDER", help="the token folder to write")
    parser.add_argument("--tokenizer", default="bytes",
                        help='"bytes" (default), a tokenizer.json, or an HF model or tokenizer folder holding one')
    parser.add_argument("--eos-token", metavar="TOKEN",
                        help="the end-of-text token each document ends with (default: the folder's "
                             "tokenizer_config.json, else a special token such as <|endoftext|> or </s>)")
    parser.add_argument("--text-column", default="text", help='the column of jsonl/parquet/... inputs (default "text")')
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: one per CPU)")
    parser.add_argument("--docs-per-shard", type=int, default=None, help="documents per .ds file (default 50000)")
    args = parser.parse_args(argv)
    return guarded(lambda: _prepare(args))


def _prepare(args: argparse.Namespace) -> int:
    from nanoflow.data.prepare import DOCS_PER_SHARD, PrepareError, prepare
    try:
        summary = prepare(args.inputs, args.output, tokenizer=args.tokenizer, eos_token=args.eos_token,
                          text_column=args.text_column, num_proc=args.num_proc,
                          docs_per_shard=args.docs_per_shard or DOCS_PER_SHARD)
    except FileNotFoundError as e:  # an input that is not there
        raise PrepareError(str(e)) from None
    resumed = f" ({summary['resumed']} already done by an earlier run)" if summary["resumed"] else ""
    log.info(f"{summary['output']}: {summary['documents']:,} documents, {summary['tokens']:,} tokens in "
             f"{summary['files']} files{resumed}; tokenizer {summary['tokenizer']}, {summary['token_size']}-byte "
             f"tokens; read back and verified in {summary['seconds']:.1f}s")
    return EXIT_DONE


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/export"),
        description="Write a checkpoint as an HF transformers folder of its model family (config.json as transformers "
                    "writes that model_type, the weights, the tokenizer) that AutoModelForCausalLM.from_pretrained and "
                    "AutoTokenizer.from_pretrained load.",
        epilog=f"Example: {program('bin/export')} runs/curriculum hf/curriculum")
    parser.add_argument("checkpoint", help="a run folder (its latest committed checkpoint) or a step folder; "
                                           "local or s3://bucket/prefix")
    parser.add_argument("out_dir", help="the folder to write (local or s3://)")
    parser.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                        help="split the weights into HF's numbered shards (model-0000i-of-0000n) of at most SIZE "
                             "(bytes, or with KB/MB/GB), with an index (default 5GB)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="cast the weights (default: as saved, float32)")
    parser.add_argument("--ema", action="store_true",
                        help="export the checkpoint's weight EMA ([optimizer] ema_decay) instead of its weights")
    args = parser.parse_args(argv)
    return guarded(lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from nanoflow.interop.export import export_hf
    summary = export_hf(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size, dtype=args.dtype,
                        ema=args.ema)
    tokenizer = f"; tokenizer: {summary['tokenizer']}" if summary["tokenizer"] else "; no tokenizer"
    log.info(f"exported {'the weight EMA of ' * args.ema}step {summary['step']} to {summary['path']}: {len(summary['files'])} files, "
             f"{summary['dtype']}{tokenizer}")
    return EXIT_DONE


def _size(text: str) -> int:
    """'5GB', '500MB', '20KiB' or a plain number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    number = text.strip().upper()
    unit = number.lstrip("0123456789.")
    try:
        value = int(float(number[:len(number) - len(unit)]) * units[unit.strip()])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB or 5GB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def preview_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/preview"),
        description="Show the rows a step trains on, read as training reads them (no model is opened): decoded, with "
                    "the tokens no loss is taken on and the document boundaries marked; or, with --json, their ids.",
        epilog=f"Example: {program('bin/preview')} schedules/curriculum.toml --stage sft --rows 2")
    parser.add_argument("config", help="the run's TOML config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config key, as bin/train --set does")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--step", type=_step_number, metavar="N", help="the global step to show (default 1)")
    where.add_argument("--stage", metavar="NAME", help="show the first step of this stage")
    parser.add_argument("--rows", type=_step_number, metavar="K",
                        help="the first K rows of the step's global batch (default 4; with --json, every row)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object a row: step, row, input_ids, labels, position_ids")
    args = parser.parse_args(argv)
    return guarded(lambda: _preview(args), where=args.config)


def _preview(args: argparse.Namespace) -> int:
    from nanoflow.commands.preview import json_rows, preview, render
    config = load_config(args.config, args.overrides)
    rows = args.rows if args.rows is not None or args.json else 4
    stage, step, shown, total, tokenizer, batch = preview(config, args.step, args.stage, rows)
    text = "\n".join(json_rows(step, batch, shown)) if args.json else render(stage, step, shown, total, tokenizer, batch)
    sys.stdout.write(text + "\n")   # one write: a reader that stops early (| head -c N) finds the whole of it sent
    return EXIT_DONE


def report_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/report"),
        description="Draw RUN_DIR/report.png (loss, learning rate and tokens/s against step, stages as bands) from "
                    "RUN_DIR/metrics.jsonl and print a per-stage summary table.",
        epilog=f"Example: {program('bin/report')} runs/curriculum")
    parser.add_argument("run_dir", help="the run folder holding metrics.jsonl (checkpoints.checkpoints_path, or "
                                        "runs/s3/<bucket>/<prefix> when checkpoints go to S3)")
    parser.add_argument("--out", help="where to write the figure (default RUN_DIR/report.png); its suffix names the "
                                      "format (.png, .svg, .pdf …; PNG without one)")
    args = parser.parse_args(argv)
    return guarded(lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    from nanoflow.commands.report import check_figure_path, format_summary, write_report
    if args.out is not None:
        check_figure_path(args.out, "--out")   # before the run is read
    path, rows = write_report(args.run_dir, args.out)
    print(format_summary(rows))
    print(f"\nwrote {path}")
    return EXIT_DONE


def eval_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/eval"),
        description="Evaluate a committed checkpoint on the [[evaluation.datasets]] of a config, without training; "
                    "prints one JSON row per eval set (the rows training writes to eval.jsonl). Writes nothing.",
        epilog=f"Example: {program('bin/eval')} runs/curriculum  "
               "(or runs/curriculum/300, s3://bucket/run, with a CONFIG)")
    parser.add_argument("checkpoint", help="a run folder (its latest committed checkpoint) or a step folder, "
                                           "local or s3://")
    parser.add_argument("config", nargs="?", help="the TOML config whose eval sets to use (default: the config "
                                                  "the checkpoint recorded)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config key, as in bin/train. {SET_PATHS} Repeatable.")
    harness = parser.add_argument_group("lm-evaluation-harness (pip install '.[lm-eval]')")
    harness.add_argument("--lm-eval", metavar="TASKS",
                         help="instead of the eval sets, run EleutherAI's lm-evaluation-harness on the checkpoint's "
                              "HF export: its task names, *.yaml task files or a folder of them, comma-separated; "
                              "prints one JSON row per task")
    harness.add_argument("--lm-eval-include", metavar="DIR", help="a folder of task YAML files to add to lm-eval's")
    harness.add_argument("--lm-eval-batch-size", type=_count, default=16, metavar="N",
                         help="requests per forward (default 16)")
    args = parser.parse_args(argv)
    if args.lm_eval is None and args.lm_eval_include is not None:
        parser.error("--lm-eval-include needs --lm-eval TASKS")
    if args.lm_eval is not None and (args.config or args.overrides):
        parser.error("--lm-eval scores the checkpoint as exported; a CONFIG or --set has nothing to change there")
    if args.lm_eval is not None:
        return guarded(lambda: _lm_eval(args), where=args.checkpoint)
    return guarded(lambda: _eval(args), where=args.config)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number (1 or more)")
    return int(text)


def _lm_eval(args: argparse.Namespace) -> int:
    from nanoflow.interop.harness import require_lm_eval, run_lm_eval
    require_lm_eval()   # before the checkpoint is read: a missing package is one line, not minutes later
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("bin/eval --lm-eval runs in one process; run it without torchrun")
    # stdout is the rows': lm-eval's own prints go beside the messages
    with console.routed(sys.stderr), contextlib.redirect_stdout(sys.stderr):
        rows, _ = run_lm_eval(args.checkpoint, args.lm_eval, include_path=args.lm_eval_include,
                              batch_size=args.lm_eval_batch_size)
    print("\n".join(json.dumps(row) for row in rows), flush=True)
    return EXIT_DONE


def _eval(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides) if args.config else None
    from nanoflow.evaluation import evaluate_checkpoint, format_rows
    from nanoflow.parallel.mesh import init_topology, shutdown
    try:
        topology = init_topology(config) if config is not None else None
        main = os.environ.get("RANK", "0") == "0"
        with console.routed(sys.stderr, enabled=main):   # stdout is the rows', for piping; messages go beside them
            rows = evaluate_checkpoint(args.checkpoint, config, args.overrides, topology)
        if main:   # under torchrun, one copy of the rows
            print(format_rows(rows), flush=True)
    finally:
        shutdown()
    return EXIT_DONE


def average_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bin/average",
        description="Write the (weighted) mean of a run's committed checkpoints' model weights as a committed "
                    "checkpoint in OUT_DIR (no optimizer state): for bin/eval, bin/export, init_from, or "
                    "resume_checkpoint_path with load_optimizer = false.",
        epilog="Example: bin/average runs/trunk runs/trunk-avg --last 3")
    parser.add_argument("run_dir", help="the run folder whose checkpoints to average (local or s3://)")
    parser.add_argument("out_dir", help="a new run folder for the averaged checkpoint (local or s3://)")
    parser.add_argument("--last", metavar="K", help="average the K most recently committed checkpoints of the run's "
                                                    "latest history (not the steps a --fresh start left behind)")
    parser.add_argument("--steps", metavar="A,B,...", help="average these committed steps")
    parser.add_argument("--weights", metavar="W,W,...", help="one weight per checkpoint, in step order "
                                                             "(normalised; default: uniform)")
    parser.add_argument("--ema", action="store_true", help="average the checkpoints' weight EMAs ([optimizer] "
                                                           "ema_decay) instead of their weights")
    args = parser.parse_args(argv)
    return guarded(lambda: _average(args), where=args.run_dir)


def _numbers(option: str, text: str | None, kind=int) -> list | None:
    from nanoflow.checkpoint.average import AverageError
    if text is None:
        return None
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise AverageError(f"{option} {text!r}: expected comma-separated {'step numbers' if kind is int else 'numbers'}"
                           ) from None


def _average(args: argparse.Namespace) -> int:
    from nanoflow.checkpoint.average import AverageError, average_checkpoints
    last = _numbers("--last", args.last)
    if last is not None and len(last) != 1:
        raise AverageError(f"--last {args.last!r}: expected one number of checkpoints")
    summary = average_checkpoints(args.run_dir, args.out_dir, last=None if last is None else last[0],
                                  steps=_numbers("--steps", args.steps), weights=_numbers("--weights", args.weights, float), ema=args.ema)
    sources = ", ".join(f"{s.rstrip('/').rpartition('/')[2]} ({w:.3g})" for s, w in zip(summary["sources"], summary["weights"], strict=True))
    log.info(f"averaged steps {sources} into {summary['path']} (step {summary['step']}, "
             f"{'their weight EMAs' if args.ema else 'model weights'} only)")
    return EXIT_DONE


def compare_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bin/compare",
        description="Compare runs: one figure of held-out loss against step and against training FLOPs (a trunk's "
                    "FLOPs counted once, shared by its branches), and a table: steps, FLOPs, final held-out loss per "
                    "eval set, the gap to the cosine run of the same length, the compute a shared trunk saved.",
        epilog="Example: bin/compare runs/trunk runs/cooldown-* runs/cosine-* --output compare.png")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run folders holding eval.jsonl; a run on S3 by its s3:// URL or its local record folder "
                             "runs/s3/<bucket>/<prefix>")
    parser.add_argument("--output", default="compare.png", help="the figure to write, exactly there (default "
                                                                "compare.png); its suffix names the format (PNG "
                                                                "without one)")
    parser.add_argument("--dataset", help="the eval set to draw (default: the first)")
    args = parser.parse_args(argv)
    return guarded(lambda: _compare(args))


def _compare(args: argparse.Namespace) -> int:
    from nanoflow.commands.compare import check_dataset, format_table, plot, read_runs
    from nanoflow.commands.report import check_figure_path
    check_figure_path(args.output, "--output")   # before any run is read
    runs = read_runs(args.run_dirs)
    check_dataset(runs, args.dataset)
    path = plot(runs, args.output, args.dataset)
    print(format_table(runs))
    print(f"\nwrote {path}")
    return EXIT_DONE


def sweep_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bin/sweep",
        description="Run a study: the runs of a STUDY.toml in order (each bin/train BASE --set ...; cooldown "
                    "branches from a trunk's checkpoints), its checkpoint averages, then bin/compare over them all. "
                    "Stoppable and rerunnable: each run resumes, runs done are passed over.",
        epilog="Example: bin/sweep schedules/wsd_vs_cosine/study.toml")
    parser.add_argument("study", help="the study's TOML file")
    parser.add_argument("--only", action="append", metavar="RUN", help="train only this run (repeatable)")
    args = parser.parse_args(argv)
    return guarded(lambda: _sweep(args), where=args.study)


def _sweep(args: argparse.Namespace) -> int:
    from nanoflow.commands.sweep import run_study
    return run_study(args.study, args.only, train_main=_train_in_sweep)


def _train_in_sweep(argv: list[str]) -> int:
    """One run of a study: bin/train's front end, with the start-up handlers of a command around it (a run that
    finished ignores every stop signal from then on; the study's next start-up, averages and comparison do not)."""
    signals.reinstall_start_up_handlers()
    try:
        return train_main(argv)
    finally:
        signals.reinstall_start_up_handlers()


def convert_nanotron_config_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=program("bin/convert-nanotron-config"),
        description="Convert a nanotron YAML config to a nanoflow TOML config on standard output; every key that "
                    "cannot be carried over is named on standard error (and in a comment at the top of the TOML).",
        epilog=f"Example: {program('bin/convert-nanotron-config')} config.yaml > schedule.toml")
    parser.add_argument("config", help="a nanotron YAML config")
    args = parser.parse_args(argv)
    return guarded(lambda: _convert_nanotron_config(args), where=args.config)


def _convert_nanotron_config(args: argparse.Namespace) -> int:
    from nanoflow.interop.nanotron import convert
    from nanoflow.interop.nanotron_yaml import read_nanotron_yaml
    text, report = convert(read_nanotron_yaml(args.config))
    sys.stdout.write(text)
    for line in report.lines():
        print(f"{args.config}: {line}", file=sys.stderr)
    return EXIT_DONE


# ---------------------------------------------------------------------------------------------
# The console scripts ([project.scripts] in pyproject.toml: nanoflow-train, …) and what bin/* run.
# Each ends the process with its front end's exit status, through exit_process (see above).

def train_command() -> None:
    signals.install_start_up_handlers()  # before torch is imported: its seconds are start-up too
    threads.choose_by_default()   # each command that computes: nanoflow.parallel.threads
    exit_process(train_main())


def verify_resume_command() -> None:
    threads.choose_by_default()
    exit_process(verify_resume_main())


def prepare_command() -> None:
    exit_process(prepare_main())


def export_command() -> None:
    exit_process(export_main())


def preview_command() -> None:
    exit_process(preview_main())


def report_command() -> None:
    exit_process(report_main())


def eval_command() -> None:
    threads.choose_by_default()
    exit_process(eval_main())


def average_command() -> None:
    exit_process(average_main())


def compare_command() -> None:
    exit_process(compare_main())


def sweep_command() -> None:
    signals.install_start_up_handlers()  # as bin/train's: a stop signal while a run starts up ends the study with 75
    threads.choose_by_default()
    exit_process(sweep_main())


def convert_nanotron_config_command() -> None:
    exit_process(convert_nanotron_config_main())
