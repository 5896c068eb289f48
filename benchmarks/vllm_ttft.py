"""Time to first token inside vLLM: recomputation against kvtier's CPU slots and NVMe rows.

One vLLM process (its CPU build unless a GPU is present) serves Gemma-3-270M
(kvtier's standard checkpoint, see ``kvtier._models.gemma3_270m_checkpoint``)
with kvtier as its offloading backend (CPU slots and an NVMe root in a
temporary folder). Every repeat takes a fresh prompt of ``--tokens`` random
token ids and times ``llm.generate`` of one token, side by side in one run:

- ``recompute``: the prompt is new; its prefill is computed (and stored);
- ``gpu_prefix``: the same prompt again, from vLLM's own prefix cache;
- ``cpu``: after ``reset_prefix_cache()``, from kvtier's CPU slots;
- ``nvme``: after ``reset_prefix_cache(reset_connector=True)`` (kvtier's CPU
  slots emptied, its rows kept), from NVMe rows.

The pauses between the steps (for the store and the row writes to finish)
are not timed. Medians and spreads (min-max) in ms, over ``--repeat`` prompts.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_ttft.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from typing import Any

STEPS = ("recompute", "gpu_prefix", "cpu", "nvme")


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="prompt length in tokens")
    ap.add_argument("--repeat", type=int, default=5, help="prompts (runs per step)")
    ap.add_argument("--pause", type=float, default=2.0, help="untimed seconds between steps")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvtier._models import gemma3_270m_checkpoint

    root = tempfile.mkdtemp(prefix="kvtier-ttft-")
    llm = LLM(
        model=str(gemma3_270m_checkpoint()),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=args.tokens + 64,
        kv_cache_memory_bytes=512 << 20,
        gpu_memory_utilization=0.2,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVTierOffloadingSpec",
                "spec_module_path": "kvtier.vllm",
                "cpu_bytes": 1 << 30,
                "nvme_root": root,
                "nvme_capacity_bytes": 4 << 30,
            },
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    rng = random.Random(0)
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    cached: dict[str, list[int]] = {s: [] for s in STEPS}

    def timed(step: str, prompt: Any) -> None:
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        times[step].append((time.perf_counter() - t) * 1e3)
        cached[step].append(out.num_cached_tokens)

    # One untimed prompt first: vLLM's first forward pays one-time costs.
    llm.generate(
        [TokensPrompt(prompt_token_ids=[rng.randrange(3, 200_000) for _ in range(args.tokens)])],
        params,
        use_tqdm=False,
    )
    for _ in range(args.repeat):
        prompt = TokensPrompt(
            prompt_token_ids=[rng.randrange(3, 200_000) for _ in range(args.tokens)]
        )
        timed("recompute", prompt)
        time.sleep(args.pause)
        timed("gpu_prefix", prompt)
        llm.reset_prefix_cache()
        time.sleep(args.pause)
        timed("cpu", prompt)
        time.sleep(args.pause)
        llm.reset_prefix_cache(reset_connector=True)
        time.sleep(args.pause)
        timed("nvme", prompt)
        time.sleep(args.pause)

    base = statistics.median(times["recompute"])
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.node(),
        "tokens": args.tokens,
        "repeat": args.repeat,
        "steps": {},
    }
    print(f"TTFT of a {args.tokens}-token prompt, ms (median, min-max of {args.repeat})")
    for s in STEPS:
        med = statistics.median(times[s])
        res["steps"][s] = {
            "ms": times[s],
            "median_ms": med,
            "cached_tokens": cached[s],
            "vs_recompute": med / base,
        }
        print(
            f"  {s:<11} {med:8.1f}  ({min(times[s]):.1f}-{max(times[s]):.1f})"
            f"  {med / base:5.2f}x of recompute  cached tokens {cached[s]}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
