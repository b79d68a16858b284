"""A dataset scored on a Ray cluster (`logprobe score --input F --output out.parquet --ray`): a Ray Data
pipeline that reads the input on the cluster's workers, scores it on a pool of actors, each holding one
engine (`InProcessScorer.from_model`), and writes Parquet parts that merge into the output.

The input (a file, a directory or a glob of files) is read and checked by Ray Data's readers and Ray tasks
(ray_input: the same rows, row indices, ids and error messages as the in-process job, the whole input
never on the driver), and cut into chunks of like contexts and lengths, ordered within each input block.
A chunk is the unit of work and of retry: an actor that dies mid-chunk is restarted by Ray and the chunk
scored again (Ray Data gives its actors unlimited restarts and task retries), and a chunk's result
reaches the driver once, whichever attempt produced it. The driver writes each result as it arrives into
`<output>.parts/` with the in-process job's `Parts` (a part whole or absent, a manifest of input and
options), so the same command again skips the rows already there (they are dropped before scoring, by
their input index), and at the end merges the parts in input order, each row once, checking that every
row is there, into the output file as the in-process job does. Without --ray-address a local Ray bound to
127.0.0.1 is started (cluster.local_ray_environment, as `logprobe serve --replicas` does).
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

from . import columns, progress as progress_mod
from .columns import ScoreOptions
from .io import DatasetError, Row, format_of, require_data_extra
from .job import Parts, ReadOptions, fingerprint, write_table
from .ray_input import INDEX, check_options, input_files, prepare


class ScoreWorker:
    """One actor of the pool: loads the model once, then scores the blocks Ray Data hands it."""

    def __init__(self, model: str | None, dtype: str, device: str, options: ScoreOptions):
        from .scorer import InProcessScorer  # in the worker's process: the model and torch load there

        self.scorer = InProcessScorer.from_model(model=model, dtype=dtype, device=device, options=options)

    def __call__(self, batch):
        """A block (index, id, text, context) -> its scores (the output columns and the index)."""
        rows = [Row(index, row_id, text, context) for index, row_id, text, context in
                zip(*(batch.column(name).to_pylist() for name in (INDEX, "id", "text", "context")))]
        scored = self.scorer.score(rows)
        return scored.append_column(INDEX, batch.column(INDEX))


def start_ray(address: str | None, workers: int) -> None:
    """Join the cluster at `address`, or start a local one on loopback with at least a CPU a worker.
    A Ray already initialized in this process (a notebook, a test) is used as it is."""
    from ..cluster import local_ray_environment  # Ray Serve's package, with a cluster only

    local_ray_environment(joining=bool(address))
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False, logging_level=logging.WARNING)


def run(input_path: str, output_path: str, options: ScoreOptions = ScoreOptions(),
        read_opts: ReadOptions = ReadOptions(), *, model: str | None = None, dtype: str = "float32",
        device: str = "cpu", workers: int = 2, ray_address: str | None = None, batch_rows: int = 256,
        progress: str = "auto", on_block=None, resume: bool = True) -> int:
    """Score `input_path` on `workers` actors into `output_path` (.parquet, .jsonl or .csv, as the
    in-process job writes it); returns the number of rows written.

    `progress` and `resume` as for job.run; `on_block(rows_done, rows_total)` is called on the driver
    as each block's result has been written to the parts. DatasetError for bad input or options, and
    for a row a worker refused (without skip_invalid); then no output is written and no parts kept."""
    require_data_extra()
    out_format = format_of(output_path)
    if out_format == "txt":
        raise DatasetError(f"{output_path}: the output is .parquet, .jsonl or .csv")
    if workers < 1:
        raise DatasetError(f"--workers must be at least 1, not {workers}")
    if batch_rows < 1:
        raise DatasetError(f"a batch must hold at least one row, not {batch_rows}")
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(out_dir):
        raise DatasetError(f"cannot write {output_path}: no directory {out_dir}")
    files, kind = input_files(input_path)
    check_options(input_path, kind, read_opts)
    manifest = {**manifest_of(input_path, files, options, read_opts), "model": model, "dtype": dtype}
    parts = Parts(output_path + ".parts", manifest)
    try:
        done = parts.open(resume)
        start_ray(ray_address, workers)
        chunks, num_rows = prepare(input_path, files, kind, read_opts, done, batch_rows, workers)
        if num_rows == 0:
            write_table(columns.to_table([], options), output_path, out_format)
            parts.remove()
            return 0
        parts.create()
        if chunks:
            bar = progress_mod.make(progress, num_rows, len(done))
            try:
                score_blocks(chunks, options, model=model, dtype=dtype, device=device, workers=workers,
                             on_result=_writer(parts, options, bar, num_rows, len(done), on_block))
            except DatasetError:  # a refused row: the job is refused as a whole, as in process
                parts.remove()
                raise
            finally:
                bar.close()
        table = parts.merged(num_rows)
        write_table(table, output_path, out_format)
        parts.remove()
        return table.num_rows
    finally:
        parts.release()


def manifest_of(input_path: str, files: list[str], options: ScoreOptions, read_opts: ReadOptions) -> dict:
    """What a set of parts was made from: each input file (path, size, a hash of its ends) and the options;
    a resume must read the same input with the same options."""
    import dataclasses

    return {"input": os.path.abspath(input_path), "runner": "ray",
            "files": [[os.path.abspath(f), os.path.getsize(f), fingerprint(f)] for f in files],
            "options": dataclasses.asdict(options), "read": dataclasses.asdict(read_opts)}


def _writer(parts: Parts, options: ScoreOptions, bar, total: int, done: int, on_block):
    """Each scored block into the parts (the output's columns, keyed by input row), then the progress."""

    def on_result(block) -> None:
        nonlocal done
        table = block.drop_columns([INDEX] if options.skip_invalid else [INDEX, "error"])
        parts.write(block.column(INDEX).to_pylist(), table)
        done += block.num_rows
        bar.update(block.num_rows, sum(n or 0 for n in block.column("num_tokens").to_pylist()))
        if on_block is not None:
            on_block(done, total)

    return on_result


def score_blocks(chunks: list, options: ScoreOptions, *, model, dtype, device, workers, on_result) -> None:
    """Score the chunks (references to Arrow tables) on the pool; `on_result(block)` for each scored chunk
    as it comes."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job prints its own (rows and tokens, not Ray's operators)
    context.print_on_execution_start = False
    gpu = device.startswith("cuda")
    dataset = ray.data.from_arrow_refs(chunks).map_batches(
        ScoreWorker, fn_constructor_kwargs={"model": model, "dtype": dtype, "device": device,
                                            "options": replace(options, skip_invalid=True)},
        batch_size=None, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=1, num_gpus=1 if gpu else 0)
    for block in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        if not options.skip_invalid:
            refuse_invalid(block)
        on_result(block)


def refuse_invalid(block) -> None:
    """Without skip_invalid a row that cannot be scored ends the job, as in process; the workers score
    with skip_invalid (a refusal raised in a worker reaches the driver as Ray's text, not as an error
    the CLI can print), and the first block with a refused row stops the pipeline here."""
    errors = block.column("error")
    if errors.null_count == block.num_rows:
        return
    bad = [k for k, message in enumerate(errors.to_pylist()) if message is not None]
    first = min(bad, key=lambda k: block.column(INDEX)[k].as_py())
    raise DatasetError(f"row {block.column(INDEX)[first].as_py()} (id {block.column('id')[first].as_py()!r}) "
                       f"cannot be scored: {errors[first].as_py()}; --skip-invalid scores the others and records "
                       "why in an 'error' column")


def run_from_args(args, output_path: str, options: ScoreOptions, read_opts: ReadOptions, progress: str) -> int:
    """`logprobe score --input ... --ray`: the flags that mean something here, checked, then `run`."""
    if args.url:
        raise DatasetError("--ray scores on workers that load the model; --url scores on running servers: "
                           "give one of them")
    return run(args.input, output_path, options, read_opts, model=args.model, dtype=args.dtype, device=args.device,
               workers=args.workers, ray_address=args.ray_address, batch_rows=args.chunk_rows, progress=progress,
               resume=args.resume)
