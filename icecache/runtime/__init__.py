"""Runtime: the IceCache transformers cache (cache, layer, placement, selection, loader, store, index workers),
the "icecache" attention function, one-call generation and model loading.

The package registers the "icecache" attention function with transformers when it is first imported (the
runtime's first use); `icecache.sim` and `icecache.core` never import it.
"""

from icecache.runtime.attention import register_attention

register_attention()
