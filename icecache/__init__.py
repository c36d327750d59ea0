"""IceCache: memory-efficient KV-cache management for long-sequence LLM decoding.

    import icecache
    model, tokenizer = icecache.load_model()              # embedded SmolLM2-135M-Instruct
    cfg = icecache.IceCacheConfig(budget=256, page_size=16, sink=4, window=64, index="mdci")
    text = icecache.generate(model, tokenizer, "...", config=cfg, max_new_tokens=32)
    pager = icecache.make_pager("mdci", head_dim=64, page_size=16, seed=0)

Importing the package does nothing else: every name below is imported from its module on first use (so
``import icecache.sim`` loads neither torch nor transformers). The runtime's first use (`IceCache`,
`load_model`, `generate`) registers the ``"icecache"`` attention function with transformers;
`register_attention` does it explicitly, for a model switched to ``attn_implementation="icecache"`` first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from icecache.core.lazy import lazy_exports

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY = {
    "IceCacheConfig": "icecache.core.config",
    "IceCacheError": "icecache.core.errors",
    "PageSelection": "icecache.core.pager",
    "SemanticPager": "icecache.core.pager",
    "PageTable": "icecache.core.pages",
    "make_pager": "icecache.indexes.registry",
    "register_pager": "icecache.indexes.registry",
    "available_pagers": "icecache.indexes.registry",
    "load_model": "icecache.runtime.models",
    "model_settings": "icecache.runtime.models",
    "IceCache": "icecache.runtime.cache",
    "generate": "icecache.runtime.generate",
    "GenerationResult": "icecache.runtime.generate",
    "register_attention": "icecache.runtime.attention",
}

__all__ = [
    "GenerationResult",
    "IceCache",
    "IceCacheConfig",
    "IceCacheError",
    "PageSelection",
    "PageTable",
    "SemanticPager",
    "__version__",
    "available_pagers",
    "generate",
    "load_model",
    "make_pager",
    "model_settings",
    "register_attention",
    "register_pager",
]

if TYPE_CHECKING:
    from icecache.core.config import IceCacheConfig as IceCacheConfig
    from icecache.core.errors import IceCacheError as IceCacheError
    from icecache.core.pager import PageSelection as PageSelection
    from icecache.core.pager import SemanticPager as SemanticPager
    from icecache.core.pages import PageTable as PageTable
    from icecache.indexes.registry import available_pagers as available_pagers
    from icecache.indexes.registry import make_pager as make_pager
    from icecache.indexes.registry import register_pager as register_pager
    from icecache.runtime.attention import register_attention as register_attention
    from icecache.runtime.cache import IceCache as IceCache
    from icecache.runtime.generate import GenerationResult as GenerationResult
    from icecache.runtime.generate import generate as generate
    from icecache.runtime.models import load_model as load_model
    from icecache.runtime.models import model_settings as model_settings


__getattr__, __dir__ = lazy_exports("icecache", _LAZY, globals())
