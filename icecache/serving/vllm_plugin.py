"""The vLLM general plugin of IceCache (entry point ``vllm.general_plugins: icecache``; docs/serving.md).

vLLM runs `register` once in every process it starts (API server, engine core, worker), in every vLLM run of
the environment where icecache is installed. It replaces the class behind ``AttentionBackendEnum.CPU_ATTN``
(the only backend name the CPU platform honours) with `icecache.serving.vllm_backend.IceCacheCPUBackend`,
which behaves exactly like vLLM's CPU backend unless the run's ``additional_config`` has an ``"icecache"``
entry. On other platforms nothing changes (they do not resolve ``CPU_ATTN``).

`icecache_config` turns ``additional_config["icecache"]`` into a validated `IceCacheConfig`.

This module imports nothing heavy at import time: `register` runs in vLLM's worker *before* the worker scans
every loaded module to rebind its Triton kernels (``CpuPlatform.register_triton_kernel_overrides``), and that
scan fails on llvmlite's FFI wrapper objects (``AttributeError: '_lib_fn_wrapper' object has no attribute
'get'``), so numba (which `icecache.core` loads) must not be imported before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from icecache.core.config import IceCacheConfig

BACKEND_PATH = "icecache.serving.vllm_backend.IceCacheCPUBackend"
CONFIG_KEY = "icecache"
#: the `IceCacheConfig` fields the plugin implements (the others are HF-runtime or simulator settings)
SUPPORTED_KEYS = ("budget", "sink", "window", "page_size", "index", "index_params", "dense_layers", "seed", "gqa", "top_p")


def register() -> None:
    """Point ``CPU_ATTN`` at IceCache's CPU backend (idempotent; per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def icecache_config(additional_config: Any) -> IceCacheConfig | None:
    """The `IceCacheConfig` that vLLM's ``additional_config`` asks for, or None when it has no ``"icecache"``
    entry (then the backend is vLLM's own). Raises `ConfigError` (one line) for anything it cannot honour."""
    from icecache.core.config import IceCacheConfig
    from icecache.core.errors import ConfigError

    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[CONFIG_KEY]
    if not isinstance(raw, dict):
        raise ConfigError(f'additional_config["icecache"] must be a JSON object of IceCacheConfig fields, got {raw!r}')
    unknown = sorted(set(raw) - set(SUPPORTED_KEYS))
    if unknown:
        raise ConfigError(
            f'additional_config["icecache"] has unknown or unsupported key(s) {", ".join(unknown)}; '
            f"the vLLM plugin takes {', '.join(SUPPORTED_KEYS)}"
        )
    values = dict(raw)
    if "dense_layers" in values and isinstance(values["dense_layers"], list):
        values["dense_layers"] = tuple(values["dense_layers"])
    cfg = IceCacheConfig(**values)
    if cfg.index == "auto":
        raise ConfigError('additional_config["icecache"]: index "auto" is not supported by the vLLM plugin yet; name a pager ("exact", "mdci", ...)')
    return cfg


def check_index(cfg: IceCacheConfig, head_dim: int) -> None:
    """Raise `ConfigError` unless ``cfg.index`` / ``cfg.index_params`` make a pager for ``head_dim``."""
    from icecache.runtime.pager_choice import check_pager_config

    check_pager_config(cfg, head_dim)
