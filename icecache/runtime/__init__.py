"""Runtime: host store, bulk loader, transformers integration, prefill pipeline, model loading."""
