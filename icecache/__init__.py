"""IceCache: memory-efficient KV-cache management for long-sequence LLM decoding.

    import icecache
    model, tokenizer = icecache.load_model()              # embedded SmolLM2-135M-Instruct
    cfg = icecache.IceCacheConfig(budget=256, page_size=16, sink=4, window=64, index="mdci")
    text = icecache.generate(model, tokenizer, "...", config=cfg, max_new_tokens=32)
    pager = icecache.make_pager("mdci", head_dim=64, page_size=16, seed=0)
"""

from icecache.core.config import IceCacheConfig
from icecache.core.errors import IceCacheError
from icecache.core.pager import PageSelection, SemanticPager
from icecache.core.pages import PageTable
from icecache.indexes.registry import available_pagers, make_pager, register_pager
from icecache.runtime.attention import register as _register_attention
from icecache.runtime.cache import IceCache
from icecache.runtime.generate import GenerationResult, generate
from icecache.runtime.models import load_model

_register_attention()  # makes attn_implementation="icecache" available to transformers

__version__ = "0.1.0"

__all__ = [
    "IceCacheConfig",
    "IceCacheError",
    "PageSelection",
    "SemanticPager",
    "PageTable",
    "make_pager",
    "register_pager",
    "available_pagers",
    "load_model",
    "IceCache",
    "generate",
    "GenerationResult",
    "__version__",
]
