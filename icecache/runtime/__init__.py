"""Runtime: the IceCache transformers cache (cache, layer, placement, selection, loader, store, index workers),
the "icecache" attention function, one-call generation and model loading."""
