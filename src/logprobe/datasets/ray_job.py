"""A dataset scored on a Ray cluster (`logprobe score --input F --output out.parquet --ray`): a Ray Data
pipeline whose map stage is a pool of actors, each holding one engine (`InProcessScorer.from_model`).

The driver reads and checks the input with the same code as the in-process job (io.read_rows: the same
rows, ids and errors), orders the rows by context and length so that each batch is of like lengths,
and hands them to Ray Data as blocks of `batch_rows` rows. A block is the unit of work and of retry:
an actor that dies mid-batch is restarted by Ray and the block scored again (Ray Data gives its actors
unlimited restarts and task retries), and a block's result reaches the driver once, whichever attempt
produced it. The driver puts the results back in input order, checks that every row came back exactly
once, and writes the output file as the in-process job does (job.write_table: Parquet, JSON lines or
CSV; a temporary name, fsync, rename), nothing of a failed run left behind. Without --ray-address a
local Ray bound to 127.0.0.1 is started (cluster.local_ray_environment, as `logprobe serve --replicas`
does). The job does not resume: the unit of a retry is a block, and of a failure the job.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from . import columns, progress as progress_mod
from .columns import ScoreOptions
from .io import DatasetError, Row, format_of, read_rows, require_data_extra
from .job import ReadOptions, write_table

INDEX = "__row_index"  # the input position each block carries through the map stage


class ScoreWorker:
    """One actor of the pool: loads the model once, then scores the blocks Ray Data hands it."""

    def __init__(self, model: str | None, dtype: str, device: str, options: ScoreOptions):
        from .scorer import InProcessScorer

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
    from ..cluster import local_ray_environment

    local_ray_environment(joining=bool(address))
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False, logging_level=logging.WARNING)


def input_blocks(rows: list[Row], batch_rows: int) -> list:
    """The rows as Arrow tables of at most `batch_rows` rows, like contexts and lengths together (the
    prefix cache keeps a shared context; a batch of like lengths pads little)."""
    import pyarrow as pa

    ordered = sorted(rows, key=lambda r: (r.context or "", len(r.text), r.index))
    blocks = []
    for start in range(0, len(ordered), batch_rows):
        chunk = ordered[start:start + batch_rows]
        blocks.append(pa.table({INDEX: pa.array([r.index for r in chunk], pa.int64()),
                                "id": pa.array([r.id for r in chunk], pa.string()),
                                "text": pa.array([r.text for r in chunk], pa.string()),
                                "context": pa.array([r.context for r in chunk], pa.string())}))
    return blocks


def run(input_path: str, output_path: str, options: ScoreOptions = ScoreOptions(),
        read_opts: ReadOptions = ReadOptions(), *, model: str | None = None, dtype: str = "float32",
        device: str = "cpu", workers: int = 2, ray_address: str | None = None, batch_rows: int = 256,
        progress: str = "auto", on_block=None) -> int:
    """Score `input_path` on `workers` actors into `output_path` (.parquet, .jsonl or .csv, as the
    in-process job writes it); returns the number of rows written.

    `progress` as for job.run; `on_block(rows_done, rows_total)` is called on the driver as each
    block's result arrives. DatasetError for bad input or options, and for a row a worker refused
    (without skip_invalid); then no output is written."""
    require_data_extra()
    out_format = format_of(output_path)
    if out_format == "txt":
        raise DatasetError(f"{output_path}: the output is .parquet, .jsonl or .csv")
    if workers < 1:
        raise DatasetError(f"--workers must be at least 1, not {workers}")
    if batch_rows < 1:
        raise DatasetError(f"a batch must hold at least one row, not {batch_rows}")
    rows = read_rows(input_path, read_opts.column, read_opts.context_column, read_opts.id_column)
    if not rows:
        write_table(columns.to_table([], options), output_path, out_format)
        return 0
    start_ray(ray_address, workers)
    bar = progress_mod.make(progress, len(rows))
    try:
        # fewer rows than workers x batch_rows: smaller blocks, so that every worker gets some
        block_rows = max(1, min(batch_rows, -(-len(rows) // workers)))
        results = score_blocks(input_blocks(rows, block_rows), options, model=model, dtype=dtype, device=device,
                               workers=workers, on_result=_reporter(bar, len(rows), on_block))
    finally:
        bar.close()
    table = in_input_order(results, len(rows))
    if not options.skip_invalid:
        table = table.drop_columns(["error"])  # every row was scored (refuse_invalid)
    write_table(table, output_path, out_format)
    return len(rows)


def _reporter(bar, total: int, on_block):
    done = 0

    def on_result(block) -> None:
        nonlocal done
        done += block.num_rows
        bar.update(block.num_rows, sum(n or 0 for n in block.column("num_tokens").to_pylist()))
        if on_block is not None:
            on_block(done, total)

    return on_result


def score_blocks(blocks: list, options: ScoreOptions, *, model, dtype, device, workers, on_result) -> list:
    """The scored blocks, in the order they finish."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the job prints its own (rows and tokens, not Ray's operators)
    context.print_on_execution_start = False
    gpu = device.startswith("cuda")
    dataset = ray.data.from_arrow(blocks).map_batches(
        ScoreWorker, fn_constructor_kwargs={"model": model, "dtype": dtype, "device": device,
                                            "options": replace(options, skip_invalid=True)},
        batch_size=None, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=1, num_gpus=1 if gpu else 0)
    results = []
    for block in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        if not options.skip_invalid:
            refuse_invalid(block)
        results.append(block)
        on_result(block)
    return results


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


def in_input_order(blocks: list, num_rows: int):
    """The blocks as one table in input order, without the index; RuntimeError unless every row is
    there exactly once (a retried block must not count twice, nor a lost one pass unnoticed)."""
    import numpy as np
    import pyarrow as pa

    table = pa.concat_tables(blocks) if blocks else None
    index = np.asarray(table.column(INDEX)) if table is not None else np.zeros(0, np.int64)
    order = np.argsort(index, kind="stable")
    if len(index) != num_rows or not np.array_equal(index[order], np.arange(num_rows)):
        raise RuntimeError(f"the Ray job returned {len(index)} rows ({len(np.unique(index))} distinct) "
                           f"for {num_rows} input rows")
    return table.take(pa.array(order)).drop_columns([INDEX])


def run_from_args(args, output_path: str, options: ScoreOptions, read_opts: ReadOptions, progress: str) -> int:
    """`logprobe score --input ... --ray`: the flags that mean something here, checked, then `run`."""
    if args.url:
        raise DatasetError("--ray scores on workers that load the model; --url scores on running servers: "
                           "give one of them")
    return run(args.input, output_path, options, read_opts, model=args.model, dtype=args.dtype, device=args.device,
               workers=args.workers, ray_address=args.ray_address, batch_rows=args.chunk_rows, progress=progress)
