"""A real vLLM (CPU build) serving Gemma-3-270M, driven by the serving tests.

Run as ``python serve_child.py PLAN_JSON``. The plan names the model folder,
the connector's ``kv_connector_extra_config`` (or none: vLLM without a
connector), the prompts (token ids) and the steps. Each step prints one JSON
line on stdout:

- ``{"step": "generate"}``: greedy generation of each prompt in turn, one per call;
  prints the token ids, the sampled tokens' logprobs and
  ``num_cached_tokens`` of each prompt;
- ``{"step": "reset"}``: ``llm.reset_prefix_cache()`` (vLLM's GPU prefix
  cache only; kvtier keeps its slots);
- ``{"step": "reset_connector"}``: ``reset_prefix_cache(reset_connector=True)``;
- ``{"step": "metrics"}``: the ``vllm:kvtier_*`` and ``vllm:kv_offload_*``
  metrics of ``llm.get_metrics()``;
- ``{"step": "loop"}``: repeat reset + generate until killed.

The last line is ``{"step": "exit"}`` after vLLM's engine core shut down.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _outputs(outs: list[Any]) -> list[dict[str, Any]]:
    res = []
    for o in outs:
        c = o.outputs[0]
        logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        res.append(
            {
                "token_ids": list(c.token_ids),
                "logprobs": logprobs,
                "num_cached_tokens": o.num_cached_tokens,
            }
        )
    return res


def _metrics(llm: Any) -> dict[str, float]:
    got: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:kvtier_", "vllm:kv_offload_")) and hasattr(m, "value"):
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine")
            )
            got[f"{m.name}{{{labels}}}"] = float(m.value)
    return got


def _emit(obj: dict[str, Any]) -> None:
    print("PLAN " + json.dumps(obj), flush=True)


def main() -> None:
    plan = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {}
    if plan.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KVTierOffloadingSpec",
                "spec_module_path": "kvtier.vllm",
                **plan["connector"],
            },
        )
    t0 = time.perf_counter()
    llm = LLM(
        model=plan["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=plan.get("block_size", 32),
        max_model_len=plan.get("max_model_len", 2048),
        kv_cache_memory_bytes=plan.get("kv_cache_memory_bytes", 256 << 20),
        gpu_memory_utilization=0.2,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    _emit({"step": "ready", "seconds": time.perf_counter() - t0})
    prompts = [TokensPrompt(prompt_token_ids=p) for p in plan["prompts"]]
    params = SamplingParams(
        temperature=0, max_tokens=plan.get("max_tokens", 8), logprobs=0, detokenize=False
    )

    def generate(llm: Any) -> dict[str, Any]:
        # One prompt per call: the batch a token is computed in (and so the
        # GEMM shapes, and the last bits of a float32 logprob) is then the
        # same in every run, whatever the connector's lookups delay.
        t = time.perf_counter()
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        return {"step": "generate", "seconds": time.perf_counter() - t, "outputs": _outputs(outs)}

    for step in plan["steps"]:
        kind = step["step"]
        if kind == "generate":
            _emit(generate(llm))
        elif kind == "reset":
            llm.reset_prefix_cache()
            _emit({"step": "reset"})
        elif kind == "reset_connector":
            llm.reset_prefix_cache(reset_connector=True)
            _emit({"step": "reset_connector"})
        elif kind == "metrics":
            _emit({"step": "metrics", "metrics": _metrics(llm)})
        elif kind == "loop":
            while True:
                llm.reset_prefix_cache()
                _emit(generate(llm))
        else:
            raise ValueError(f"unknown step {kind!r}")
    llm.llm_engine.engine_core.shutdown()
    _emit({"step": "exit"})


if __name__ == "__main__":
    main()
