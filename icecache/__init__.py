"""IceCache: memory-efficient KV-cache management for long-sequence LLM decoding.

    import icecache
    model, tokenizer = icecache.load_model()              # embedded SmolLM2-135M-Instruct
    cfg = icecache.IceCacheConfig(budget=256, page_size=16, sink=4, window=64, index="mdci")
    pager = icecache.make_pager("sequential", head_dim=64, page_size=16, seed=0)
"""

from icecache.core.config import IceCacheConfig
from icecache.core.errors import IceCacheError
from icecache.core.pager import PageSelection, SemanticPager
from icecache.core.pages import PageTable
from icecache.indexes.registry import available_pagers, make_pager, register_pager
from icecache.runtime.models import load_model

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
    "__version__",
]
