"""Real-model round trip: store a model's KV cache through kvtier, drop it, load it, resume.

The flow (``kvtier roundtrip --model NAME`` runs it):

1. Load the model (:mod:`kvtier._models`), draw ``prompt_tokens`` seeded token
   ids and pick the resume point ``A``: the last block boundary strictly before
   the end of the prompt (as vLLM's prefix cache, which always recomputes at least
   one token).
2. Prefill ``[0, A)`` with a transformers ``DynamicCache``; copy it into the
   paged block tensors of ``KVLayout.from_hf_config`` (vLLM's KV cache groups)
   through per-group block tables (:func:`kvtier._hf.cache_to_blocks`).
3. The uninterrupted reference continues the same cache: prefill ``[A, P)``,
   then greedy-decode ``decode_tokens`` tokens.
4. Store every chunk of every group (keys ``OffloadKey(block_hash, group_id)``,
   block hashes chained from the token ids with SHA-256) into an engine with a
   CPU budget of exactly the number of keys and write-through to NVMe; flush;
   close; zero the paged tensors.
5. Open a NEW engine on the same NVMe root, count prefix hits, load every chunk
   into DIFFERENT GPU block ids, rebuild the ``DynamicCache``
   (:func:`kvtier._hf.blocks_to_cache`), prefill ``[A, P)`` and decode.
6. Compare token ids and logits with ``torch.equal``.

The reference prefills ``[0, A)`` then ``[A, P)`` (the same split as the resumed
run): a single-shot prefill of ``[0, P)`` is not bitwise comparable.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvtier
from kvtier._hf import HFKVGroups, blocks_to_cache, cache_to_blocks, hf_kv_groups, resident_blocks
from kvtier._models import expand_model_names, load_model

__all__ = [
    "GroupReport",
    "RoundtripReport",
    "RoundtripSuite",
    "aroundtrip",
    "block_hashes",
    "flip_payload_bit",
    "run_roundtrip",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HASH_SEED = b"kvtier-roundtrip-v1"
_PAGE = 4096


def block_hashes(token_ids: Sequence[int], tokens_per_block: int) -> list[bytes]:
    """Chain a SHA-256 hash over each FULL block of token ids.

    ``h[j] = sha256(h[j-1] || int64-le token ids of block j)``, ``h[-1]`` is a
    fixed seed. Stable across processes (never Python's ``hash()``), 32 bytes each.

    Args:
        token_ids: the sequence's token ids.
        tokens_per_block: tokens per block; a trailing partial block gets no hash.

    Returns:
        One 32-byte hash per full block.

    Raises:
        ValueError: ``tokens_per_block`` is not positive.
    """
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
    hashes: list[bytes] = []
    prev = hashlib.sha256(_HASH_SEED).digest()
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        block = torch.tensor(token_ids[start : start + tokens_per_block], dtype=torch.int64)
        prev = hashlib.sha256(prev + block.numpy().astype("<i8").tobytes()).digest()
        hashes.append(prev)
    return hashes


@dataclass(frozen=True)
class GroupReport:
    """What one KV cache group stored and loaded.

    Attributes:
        group_id: the group.
        kind: ``full``, ``sliding``, ``chunked``, ``linear``, ``mamba`` or ``mla``.
        layers: model layer indices of the group.
        keys: offload keys stored.
        blocks: GPU blocks stored (sub-blocks over all keys).
        stored_nbytes: payload bytes of those blocks.
        chunk_nbytes: ``layout.group_nbytes(group_id, blocks_per_chunk)``.
        prefix_hits: leading keys the reopened engine could serve.
        loaded: keys loaded back.
    """

    group_id: int
    kind: str
    layers: tuple[int, ...]
    keys: int
    blocks: int
    stored_nbytes: int
    chunk_nbytes: int
    prefix_hits: int
    loaded: int


@dataclass(frozen=True)
class RoundtripReport:
    """Outcome of one round trip (see the module docstring).

    Attributes:
        model: model name.
        dtype: ``"float32"`` or ``"bfloat16"``.
        prompt_tokens: prompt length ``P``.
        resume_tokens: tokens loaded from kvtier (``A``).
        decode_tokens: greedy-decoded tokens after the prompt.
        block_tokens: tokens per block.
        blocks_per_chunk: blocks per chunk.
        groups: one :class:`GroupReport` per group.
        num_keys: keys stored over all groups.
        slot_nbytes: CPU slot size (largest group chunk, 4 KiB rounded, + trailer).
        sum_slot_nbytes: the slot size if sized for the SUM of the groups.
        cpu_bytes: CPU budget (``num_keys * slot_nbytes``).
        keys_fit_largest: keys ``cpu_bytes`` holds with slots sized for the largest group.
        keys_fit_sum: keys ``cpu_bytes`` would hold with slots sized for the sum.
        store_stats: ``engine.stats()`` of the storing engine after flush.
        load_stats: ``engine.stats()`` of the reopened engine after the load.
        failed: load failures ``{key repr: error repr}``.
        missing: keys the reopened engine did not find (a MISS), not loaded.
        nvme_write_failures: rows the storing engine failed to write to NVMe.
        already_stored: keys an earlier identical round trip on the same
            ``root`` had left on NVMe (the store skipped them; the load still
            checks them bitwise).
        skipped_group: a group deliberately not loaded (negative control), or None.
        tokens_equal: resumed token ids equal the reference's.
        logits_equal: every resumed logits tensor ``torch.equal`` to the reference's.
        reference_tokens: the reference's greedy tokens.
        resumed_tokens: the resumed run's greedy tokens.
        seconds: wall time per phase in seconds.
    """

    model: str
    dtype: str
    prompt_tokens: int
    resume_tokens: int
    decode_tokens: int
    block_tokens: int
    blocks_per_chunk: int
    groups: tuple[GroupReport, ...]
    num_keys: int
    slot_nbytes: int
    sum_slot_nbytes: int
    cpu_bytes: int
    keys_fit_largest: int
    keys_fit_sum: int
    store_stats: Any
    load_stats: Any
    failed: dict[str, str]
    missing: int
    nvme_write_failures: int
    skipped_group: int | None
    tokens_equal: bool
    logits_equal: bool
    reference_tokens: tuple[int, ...]
    resumed_tokens: tuple[int, ...]
    seconds: dict[str, float] = field(default_factory=dict)
    already_stored: int = 0

    @property
    def ok(self) -> bool:
        """True when everything loaded and tokens and logits are bitwise equal."""
        return (
            self.tokens_equal
            and self.logits_equal
            and not self.failed
            and self.missing == 0
            and self.nvme_write_failures == 0
            and self.skipped_group is None
        )

    def format(self) -> str:
        """Return a human-readable multi-line summary."""
        st = self.store_stats
        lines = [
            f"model {self.model} ({self.dtype}): prompt {self.prompt_tokens} tokens, "
            f"resume at {self.resume_tokens}, decode {self.decode_tokens}; "
            f"{self.block_tokens} tokens/block, {self.blocks_per_chunk} blocks/chunk",
            f"{'group':>5} {'kind':>8} {'layers':>7} {'keys':>5} {'blocks':>6} "
            f"{'stored B':>10} {'chunk B':>9} {'hits':>5} {'loaded':>6}",
        ]
        lines.extend(
            f"{g.group_id:>5} {g.kind:>8} {len(g.layers):>7} {g.keys:>5} {g.blocks:>6} "
            f"{g.stored_nbytes:>10} {g.chunk_nbytes:>9} {g.prefix_hits:>5} {g.loaded:>6}"
            for g in self.groups
        )
        lines += [
            f"keys {self.num_keys}; slot {self.slot_nbytes} B (largest group) vs "
            f"{self.sum_slot_nbytes} B (sum of groups); cpu budget {self.cpu_bytes} B holds "
            f"{self.keys_fit_largest} keys (largest) vs {self.keys_fit_sum} keys (sum)",
            f"store: {st.store_bytes} B copied, slot waste {st.slot_waste_nbytes} B, "
            f"evictions {st.evictions}, rejected {st.rejected}, "
            f"NVMe write failures {self.nvme_write_failures}"
            + (f", {self.already_stored} keys already on NVMe" if self.already_stored else ""),
            f"load: {self.load_stats.load_bytes} B, failures {len(self.failed)}, "
            f"missing {self.missing}"
            + (f", group {self.skipped_group} skipped" if self.skipped_group is not None else ""),
            "seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items()),
            f"tokens equal: {self.tokens_equal}; logits equal: {self.logits_equal}; "
            f"reference {list(self.reference_tokens)} resumed {list(self.resumed_tokens)}",
            "ROUNDTRIP OK" if self.ok else "ROUNDTRIP MISMATCH",
        ]
        return "\n".join(lines)


def _round_up(n: int, align: int = _PAGE) -> int:
    return -(-n // align) * align


def flip_payload_bit(root: str | os.PathLike[str]) -> Path:
    """Flip one payload bit of the first row of the first segment file under ``root``.

    ``root`` may be an NVMe root or one namespace folder in it.

    Segment files are ``<root>/<namespace>-<digest>/g<group_id>/<n>.kvrows`` with
    rows at ``4096 + i * row_nbytes`` (DESIGN.md section 5); this flips bit 0 of
    the first payload byte of row 0. A checksum that works turns the key into a
    failed load (or a MISS) when it is read again.

    Returns:
        The corrupted segment file.

    Raises:
        FileNotFoundError: no segment file under ``root``.
    """
    files = sorted(Path(root).glob("**/g*/*.kvrows"))
    if not files:
        raise FileNotFoundError(f"no **/g*/*.kvrows segment file under {root}")
    with open(files[0], "r+b") as f:
        f.seek(_PAGE)
        byte = f.read(1)
        f.seek(_PAGE)
        f.write(bytes([byte[0] ^ 1]))
    return files[0]


def _greedy(
    model: Any, cache: Any, suffix: torch.Tensor, steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``suffix`` on ``cache`` then greedy-decode ``steps`` tokens."""
    logits = model(input_ids=suffix, cache=cache, use_cache=True).logits
    all_logits, tokens = [logits], []
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        tokens.append(int(token))
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        all_logits.append(logits)
    return tokens, all_logits


def _chunks(
    kv: HFKVGroups,
    group_id: int,
    hashes: list[bytes],
    num_tokens: int,
    tokens_per_block: int,
    blocks_per_chunk: int,
    block_ids: Sequence[int],
) -> list[kvtier.Chunk]:
    """The chunks of one group: resident blocks cut at chunk boundaries."""
    kind = kv.kinds[group_id]
    blocks = resident_blocks(kind, kv.window[group_id], num_tokens, tokens_per_block)
    if kind in ("linear", "mamba"):
        # The state snapshot travels with the chunk that ends at the resume point.
        key = kvtier.OffloadKey(hashes[blocks.start], group_id)
        return [kvtier.Chunk(key, [block_ids[0]], 0)]
    out: list[kvtier.Chunk] = []
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for logical, block_id in zip(blocks, block_ids, strict=True):
        by_chunk.setdefault(logical // blocks_per_chunk, []).append((logical, block_id))
    for c, members in by_chunk.items():
        last = min((c + 1) * blocks_per_chunk, len(hashes)) - 1
        key = kvtier.OffloadKey(hashes[last], group_id)
        offset = members[0][0] - c * blocks_per_chunk
        out.append(kvtier.Chunk(key, [b for _, b in members], offset))
    return out


async def aroundtrip(
    model: str,
    *,
    prompt_tokens: int = 200,
    block_tokens: int = 16,
    blocks_per_chunk: int = 4,
    dtype: str = "float32",
    root: str | os.PathLike[str] | None = None,
    decode_tokens: int = 8,
    skip_group: int | None = None,
    corrupt_one_row: bool = False,
    seed: int = 0,
    model_cache: str | os.PathLike[str] | None = None,
) -> RoundtripReport:
    """Run the round trip on the running event loop (see the module docstring).

    Args:
        model: a model name of :mod:`kvtier._models` (not ``tiny-all``).
        prompt_tokens: prompt length ``P`` (``> block_tokens``).
        block_tokens: tokens per GPU block (``>= 1``).
        blocks_per_chunk: blocks per chunk (the unit of offload, ``>= 1``).
        dtype: ``"float32"`` or ``"bfloat16"`` (model and KV cache).
        root: NVMe root directory; a temporary directory when ``None``. The
            namespace names the model, dtype, sizes and seed, so a root may be
            reused: keys an identical earlier run left there are skipped by
            the store and still checked by the load.
        decode_tokens: greedy tokens decoded after the prompt (``>= 0``).
        skip_group: negative control: do not load this group's chunks (a
            group id of the model).
        corrupt_one_row: negative control: flip one payload bit on NVMe
            between the two engines.
        seed: seed of the prompt's token ids.
        model_cache: model cache directory (:func:`kvtier._models.model_cache_dir`).

    Returns:
        The report; ``report.ok`` says whether the round trip was exact.

    Raises:
        ValueError: bad arguments (checked before the model runs).
        RuntimeError: the store was rejected or the engine evicted (the CPU
            budget holds exactly the stored keys, so neither may happen).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    for name, value, least in (
        ("block_tokens", block_tokens, 1),
        ("blocks_per_chunk", blocks_per_chunk, 1),
        ("decode_tokens", decode_tokens, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if prompt_tokens <= block_tokens:
        raise ValueError(
            f"prompt_tokens ({prompt_tokens}) must exceed block_tokens ({block_tokens})"
        )
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase] = seconds.get(phase, 0.0) + now - clock
        clock = now

    torch_dtype = _DTYPES[dtype]
    lm = await asyncio.to_thread(load_model, model, torch_dtype, cache_dir=model_cache)
    config = lm.config
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    rng = random.Random(seed)
    token_ids = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
    ids = torch.tensor([token_ids])
    resume = (prompt_tokens - 1) // block_tokens * block_tokens
    hashes = block_hashes(token_ids[:resume], block_tokens)
    lap("load_model")

    from transformers import DynamicCache

    # Reference: prefill [0, A), page the cache out, continue [A, P) and decode.
    num_blocks = resume // block_tokens + 1
    kv = hf_kv_groups(config, num_blocks, block_tokens, torch_dtype)
    if skip_group is not None and skip_group not in kv.groups:
        raise ValueError(f"skip_group {skip_group} is not a group of {model} ({sorted(kv.groups)})")
    store_ids = {
        g: random.Random(seed + 1 + g).sample(range(num_blocks), num_blocks) for g in kv.groups
    }
    load_ids = {
        g: random.Random(seed + 1001 + g).sample(range(num_blocks), num_blocks) for g in kv.groups
    }
    tables: dict[str, dict[int, list[int]]] = {"store": {}, "load": {}}
    for g in kv.groups:
        n = len(resident_blocks(kv.kinds[g], kv.window[g], resume, block_tokens))
        tables["store"][g] = store_ids[g][:n]
        tables["load"][g] = load_ids[g][:n]

    def reference() -> tuple[list[int], list[torch.Tensor]]:
        with torch.inference_mode():
            cache = DynamicCache(config=config)
            lm(input_ids=ids[:, :resume], cache=cache, use_cache=True)
            lap("prefill_prefix")
            cache_to_blocks(cache, kv, resume, tables["store"])
            lap("page_out")
            out = _greedy(lm, cache, ids[:, resume:], decode_tokens)
            lap("reference")
            return out

    ref_tokens, ref_logits = await asyncio.to_thread(reference)

    layout = kvtier.KVLayout.from_tensors(
        groups=kv.groups, block_dim=kv.block_dim, tokens_per_block=kv.tokens_per_block
    )
    chunks = {
        phase: {
            g: _chunks(kv, g, hashes, resume, block_tokens, blocks_per_chunk, tables[phase][g])
            for g in kv.groups
        }
        for phase in ("store", "load")
    }
    num_keys = sum(len(c) for c in chunks["store"].values())
    slot_nbytes = layout.slot_nbytes(blocks_per_chunk)
    sum_slot = _round_up(sum(layout.group_nbytes(g, blocks_per_chunk) for g in kv.groups)) + _PAGE
    cpu_bytes = num_keys * slot_nbytes

    with ExitStack() as stack:
        if root is None:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-roundtrip-"))
        # One segment file per group is preallocated and counts against the
        # capacity: size segments to hold every key once, capacity for all groups.
        segment_nbytes = _round_up(num_keys * slot_nbytes) + _PAGE
        nvme = kvtier.NVMeConfig(
            root=root,
            capacity_bytes=2 * len(kv.groups) * segment_nbytes,
            # Keys are block hashes of the seeded prompt: the sizes and seed
            # name the namespace, so an identical run finds identical rows.
            namespace=f"roundtrip/{model}/{dtype}/p{prompt_tokens}-t{block_tokens}"
            f"-c{blocks_per_chunk}-s{seed}",
            segment_nbytes=segment_nbytes,
        )
        engine_config = kvtier.EngineConfig(
            cpu_bytes=cpu_bytes, blocks_per_chunk=blocks_per_chunk, nvme=nvme
        )
        lap("setup")
        async with kvtier.TransferEngine(layout, engine_config) as engine:
            all_chunks = [c for g in kv.groups for c in chunks["store"][g]]
            result = await engine.store(all_chunks)
            # Skipped: left on NVMe by an identical earlier run (this engine's CPU tier is empty).
            if result.rejected or len(result.stored) + len(result.skipped) != num_keys:
                raise RuntimeError(
                    f"store of {num_keys} keys: stored {len(result.stored)}, "
                    f"skipped {len(result.skipped)}, rejected {len(result.rejected)}"
                )
            lap("store")
            await engine.flush()
            lap("flush")
            store_stats = engine.stats()
            assert engine.nvme is not None
            directory = engine.nvme.directory  # this run's namespace folder under root
        nvme_stats = store_stats.nvme or {}
        nvme_write_failures = int(nvme_stats.get("write_failures", 0))  # type: ignore[call-overload]
        if store_stats.evictions:
            raise RuntimeError(
                f"{store_stats.evictions} evictions with a budget of exactly {num_keys} keys"
            )
        for tensors in kv.groups.values():
            for tensor in tensors.values():
                tensor.zero_()
        if corrupt_one_row:
            await asyncio.to_thread(flip_payload_bit, directory)
        lap("drop")

        async with kvtier.TransferEngine(layout, engine_config) as engine:
            hits = {g: engine.prefix_hits([c.key for c in chunks["load"][g]]) for g in kv.groups}
            wanted = [c for g in kv.groups if g != skip_group for c in chunks["load"][g]]
            present = [
                c
                for c, r in zip(wanted, engine.lookup([c.key for c in wanted]), strict=True)
                if r != kvtier.Residency.MISS
            ]
            loaded = await engine.load(present)
            load_stats = engine.stats()
        lap("load")

    def resume_run() -> tuple[list[int], list[torch.Tensor]]:
        with torch.inference_mode():
            resumed = blocks_to_cache(config, kv, resume, tables["load"])
            lap("page_in")
            out = _greedy(lm, resumed, ids[:, resume:], decode_tokens)
            lap("resume")
            return out

    res_tokens, res_logits = await asyncio.to_thread(resume_run)

    loaded_keys = set(loaded.loaded)
    groups = []
    for g in kv.groups:
        layout_group = chunks["store"][g]
        groups.append(
            GroupReport(
                group_id=g,
                kind=kv.kinds[g],
                layers=tuple(kv.layers_of(g)),
                keys=len(layout_group),
                blocks=sum(len(c.block_ids) for c in layout_group),
                stored_nbytes=sum(len(c.block_ids) for c in layout_group)
                * layout.group_nbytes(g, 1),
                chunk_nbytes=layout.group_nbytes(g, blocks_per_chunk),
                prefix_hits=hits[g],
                loaded=sum(c.key in loaded_keys for c in layout_group),
            )
        )
    logits_equal = len(ref_logits) == len(res_logits) and all(
        torch.equal(a, b) for a, b in zip(ref_logits, res_logits, strict=True)
    )
    return RoundtripReport(
        model=model,
        dtype=dtype,
        prompt_tokens=prompt_tokens,
        resume_tokens=resume,
        decode_tokens=decode_tokens,
        block_tokens=block_tokens,
        blocks_per_chunk=blocks_per_chunk,
        groups=tuple(groups),
        num_keys=num_keys,
        slot_nbytes=slot_nbytes,
        sum_slot_nbytes=sum_slot,
        cpu_bytes=cpu_bytes,
        keys_fit_largest=cpu_bytes // slot_nbytes,
        keys_fit_sum=cpu_bytes // sum_slot,
        store_stats=store_stats,
        load_stats=load_stats,
        failed={
            f"OffloadKey({k.block_hash.hex()[:16]}..., group {k.group_id})": str(e)
            for k, e in loaded.failed.items()
        },
        missing=len(wanted) - len(present),
        nvme_write_failures=nvme_write_failures,
        skipped_group=skip_group,
        tokens_equal=ref_tokens == res_tokens,
        logits_equal=logits_equal,
        reference_tokens=tuple(ref_tokens),
        resumed_tokens=tuple(res_tokens),
        seconds=seconds,
        already_stored=len(result.skipped),
    )


@dataclass(frozen=True)
class RoundtripSuite:
    """The reports of several models (``tiny-all``); same ``ok`` / ``format()`` as one report.

    Attributes:
        reports: one report per model, in name order.
    """

    reports: tuple[RoundtripReport, ...]

    @property
    def ok(self) -> bool:
        """True when every model's round trip was exact."""
        return all(r.ok for r in self.reports)

    def format(self) -> str:
        """Return every report's summary, then one line per model."""
        parts = [r.format() for r in self.reports]
        parts.append(
            "\n".join(
                f"{r.model:<20} {r.dtype:<9} {'OK' if r.ok else 'MISMATCH'}" for r in self.reports
            )
        )
        return "\n\n".join(parts)


async def _run_all(names: list[str], kwargs: dict[str, Any]) -> list[RoundtripReport]:
    return [await aroundtrip(name, **kwargs) for name in names]


def run_roundtrip(
    model: str,
    *,
    prompt_tokens: int = 200,
    block_tokens: int = 16,
    blocks_per_chunk: int = 4,
    dtype: str = "float32",
    root: str | os.PathLike[str] | None = None,
    decode_tokens: int = 8,
    skip_group: int | None = None,
    corrupt_one_row: bool = False,
    seed: int = 0,
    model_cache: str | os.PathLike[str] | None = None,
) -> RoundtripReport | RoundtripSuite:
    """Run :func:`aroundtrip` in a new event loop (uvloop when installed). Blocks.

    Args:
        model: a model name, or ``tiny-all`` for every tiny model.
        prompt_tokens: see :func:`aroundtrip` (and the other arguments).
        block_tokens: tokens per GPU block.
        blocks_per_chunk: blocks per chunk.
        dtype: ``"float32"`` or ``"bfloat16"``.
        root: NVMe root (a temporary directory when ``None``).
        decode_tokens: greedy tokens decoded after the prompt.
        skip_group: negative control: do not load this group.
        corrupt_one_row: negative control: flip one payload bit on NVMe.
        seed: prompt seed.
        model_cache: model cache directory.

    Returns:
        One :class:`RoundtripReport`, or a :class:`RoundtripSuite` for ``tiny-all``.

    Raises:
        ValueError: unknown model or bad arguments.
        RuntimeError: called from a running event loop (use :func:`aroundtrip`).
    """
    kwargs: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "block_tokens": block_tokens,
        "blocks_per_chunk": blocks_per_chunk,
        "dtype": dtype,
        "root": root,
        "decode_tokens": decode_tokens,
        "skip_group": skip_group,
        "corrupt_one_row": corrupt_one_row,
        "seed": seed,
        "model_cache": model_cache,
    }
    names = expand_model_names(model)
    try:
        import uvloop
    except ImportError:  # uvloop is not available on Windows
        reports = asyncio.run(_run_all(names, kwargs))
    else:
        reports = uvloop.run(_run_all(names, kwargs))
    if model == "tiny-all":
        return RoundtripSuite(tuple(reports))
    return reports[0]
