"""Model shapes the simulator knows: the few numbers of a decoder-only transformer that set its costs.

Each shape is copied from the model's public ``config.json`` (source given per entry); parameter counts are
*derived* from the shape (projections, MLP, norms, embeddings), never typed in, so a wrong field shows up as
a wrong count. The embedded SmolLM2 shape is checked against the loaded model by the tests.

    >>> from icecache.sim.shapes import get_shape
    >>> s = get_shape("llama-3.1-8b")
    >>> s.kv_bytes_per_token(dtype_bytes=2)   # K+V, all layers, bf16
    131072

Hybrid models (Gemma 3) interleave *sliding-window* layers, which attend over the last ``sliding_window``
tokens only and keep just those on the device, with *global* (full-attention) layers. IceCache touches only
the global layers (the runtime gives sliding layers transformers' ``DynamicSlidingWindowLayer``), so a shape
lists its sliding layers and their window; a shape without them is a plain decoder where every layer is global.
"""

from __future__ import annotations

from dataclasses import dataclass

from icecache.core.errors import ConfigError, UnknownNameError


@dataclass(frozen=True)
class ModelShape:
    """The cost-relevant shape of a decoder-only transformer (Llama-style: GQA, gated MLP, RMSNorm).

    Attributes
    ----------
    name : str
        Registry key.
    layers : int
        Decoder layers L.
    q_heads, kv_heads : int
        Query heads and key/value heads (GQA group size = q_heads / kv_heads).
    head_dim : int
        Width d of one head.
    hidden : int
        Residual stream width.
    intermediate : int
        MLP inner width (gated MLP, SwiGLU or Gemma's GeGLU: gate, up, down projections).
    vocab : int
        Vocabulary size.
    tied_embeddings : bool
        True when the LM head reuses the input embedding matrix.
    qk_norm : bool
        Per-head RMSNorm on q and k (Qwen3).
    max_context : int
        The context the model was released for, in tokens (informational; the simulator may go beyond).
    source : str
        Where the numbers come from.
    sliding_layers : tuple of int
        Indices of the sliding-window layers (empty: every layer is global, i.e. attends over the whole context).
    sliding_window : int
        Tokens a sliding layer attends over (the current one included); 0 when there are no sliding layers.
    norms_per_layer : int
        RMSNorm weight vectors of width ``hidden`` per layer (2 in Llama/Qwen: before attention and MLP; 4 in
        Gemma 3, which also normalises after each).
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool
    max_context: int
    source: str
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    norms_per_layer: int = 2

    def __post_init__(self) -> None:
        for field in ("layers", "q_heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "max_context", "norms_per_layer"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ModelShape.{field} must be an int >= 1, got {v!r}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"ModelShape.q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        sl = tuple(self.sliding_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers for i in sl) or len(set(sl)) != len(sl):
            raise ConfigError(f"ModelShape.sliding_layers must be distinct layer indices in [0, {self.layers - 1}], got {sl!r}")
        object.__setattr__(self, "sliding_layers", tuple(sorted(sl)))
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or (w == 0) != (not sl):
            raise ConfigError(
                f"ModelShape.sliding_window must be an int >= 1 when there are sliding layers and 0 otherwise, got {w!r} "
                f"with {len(sl)} sliding layers"
            )
        if len(sl) == self.layers:
            raise ConfigError("ModelShape needs at least one global (full-attention) layer")

    @property
    def num_sliding(self) -> int:
        """Number of sliding-window layers."""
        return len(self.sliding_layers)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers (the only ones IceCache offloads and indexes)."""
        sl = set(self.sliding_layers)
        return tuple(i for i in range(self.layers) if i not in sl)

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    def attended_tokens(self, layer: int, context: int) -> int:
        """Keys one decode query of ``layer`` attends over at ``context`` tokens (full KV): the whole context in
        a global layer, ``min(context, sliding_window)`` in a sliding one."""
        return min(context, self.sliding_window) if self.is_sliding(layer) else context

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group g)."""
        return self.q_heads // self.kv_heads

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matrix products (q, k, v, o projections and the gated MLP)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.q_heads * d + 2 * h * self.kv_heads * d + self.q_heads * d * h
        return attn + 3 * h * self.intermediate

    def layer_params(self) -> int:
        """Weights of one decoder layer (matrix products and norms)."""
        return self.layer_matmul_params() + self.norms_per_layer * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def head_params(self) -> int:
        """Weights read once per step outside the layers: final norm + LM head (the tied matrix counts here)."""
        return self.hidden + self.vocab * self.hidden

    def total_params(self) -> int:
        """All weights (embedding + layers + final norm + untied LM head)."""
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return embed + self.layers * self.layer_params() + self.hidden + head

    def kv_bytes_per_token_layer(self, dtype_bytes: int) -> int:
        """K + V bytes of one token in one layer (all KV heads)."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K + V bytes of one token over all layers (a token inside every sliding window)."""
        return self.layers * self.kv_bytes_per_token_layer(dtype_bytes)

    def full_kv_bytes(self, context: int, dtype_bytes: int) -> int:
        """K + V bytes a full cache holds at ``context`` tokens: the whole context in global layers, the last
        ``min(context, sliding_window)`` tokens in sliding ones."""
        per = self.kv_bytes_per_token_layer(dtype_bytes)
        return sum(self.attended_tokens(layer_idx, context) for layer_idx in range(self.layers)) * per

    def page_bytes(self, page_size: int, dtype_bytes: int) -> int:
        """Bytes of one page slot (K and V of ``page_size`` tokens, one KV head)."""
        return 2 * page_size * self.head_dim * dtype_bytes

    def layer_flops_per_token(self) -> int:
        """Dense matmul FLOPs of one layer for one token (2 per multiply-add), attention scores excluded."""
        return 2 * self.layer_matmul_params()

    def attention_flops(self, query_tokens: int, kv_tokens: int, causal: bool) -> float:
        """FLOPs of the score and value products of one layer (QK^T and PV), halved when causal."""
        f = 4.0 * query_tokens * kv_tokens * self.q_heads * self.head_dim
        return f / 2.0 if causal else f

    def prefill_attention_flops(self, tokens: int, window: int) -> float:
        """Score and value FLOPs of a causal sliding-window prefill: query i attends ``min(i, window)`` keys."""
        w = min(tokens, window)
        pairs = w * (w + 1) / 2 + (tokens - w) * w
        return 4.0 * pairs * self.q_heads * self.head_dim


_HF = "https://huggingface.co/{}/blob/main/config.json"

#: The model shapes the simulator ships with (add one by adding an entry; names are lower case).
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            name="llama-3.1-8b",
            layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=128256,
            tied_embeddings=False, qk_norm=False, max_context=131072,
            source=_HF.format("meta-llama/Llama-3.1-8B-Instruct"),
        ),
        ModelShape(
            name="mistral-7b",
            layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=32768,
            tied_embeddings=False, qk_norm=False, max_context=32768,
            source=_HF.format("mistralai/Mistral-7B-Instruct-v0.3"),
        ),
        ModelShape(
            name="qwen3-4b",
            layers=36, q_heads=32, kv_heads=8, head_dim=128, hidden=2560, intermediate=9728, vocab=151936,
            tied_embeddings=True, qk_norm=True, max_context=40960,
            source=_HF.format("Qwen/Qwen3-4B") + " (native 32k; the paper runs it to 250k+ with YaRN)",
        ),
        ModelShape(
            name="smollm2-135m-instruct",
            layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152,
            tied_embeddings=True, qk_norm=False, max_context=8192,
            source=_HF.format("HuggingFaceTB/SmolLM2-135M-Instruct") + "; checked against icecache.load_model()",
        ),
        ModelShape(
            name="gemma-3-270m",
            layers=18, q_heads=4, kv_heads=1, head_dim=256, hidden=640, intermediate=2048, vocab=262144,
            tied_embeddings=True, qk_norm=True, max_context=32768,
            sliding_layers=tuple(i for i in range(18) if i not in (5, 11, 17)), sliding_window=512, norms_per_layer=4,
            source=(
                "GGUF metadata of gemma-3-270m-q4_k_m.gguf (gemma3.block_count 18, attention.head_count 4, head_count_kv 1, "
                "key_length 256, embedding_length 640, feed_forward_length 2048, attention.sliding_window 512, "
                "context_length 32768; 262144 tokens; tensor shapes: 4 norms + q/k norms per block, no output.weight, "
                "268,098,176 parameters in all) as loaded by transformers 5.2 with icecache.load_model('gemma-3-270m'), "
                "whose config.layer_types make layers 5, 11, 17 full_attention (the lead checked these numbers); "
                + _HF.format("google/gemma-3-270m")
            ),
        ),
    )
}

#: Short aliases accepted on the command line.
ALIASES: dict[str, str] = {"llama": "llama-3.1-8b", "mistral": "mistral-7b", "qwen3": "qwen3-4b", "smollm2": "smollm2-135m-instruct",
                           "gemma3": "gemma-3-270m", "gemma": "gemma-3-270m"}


def register_shape(shape: ModelShape) -> ModelShape:
    """Add ``shape`` to the registry (a different shape under a taken name raises `ConfigError`)."""
    if shape.name in SHAPES and SHAPES[shape.name] != shape:
        raise ConfigError(f"model shape {shape.name!r} is already registered with other values")
    SHAPES[shape.name] = shape
    return shape


def get_shape(name: str) -> ModelShape:
    """The shape registered as ``name`` (or an alias); raises `UnknownNameError` listing the known names."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return SHAPES[key]
    except KeyError:
        raise UnknownNameError(f"unknown model {name!r}; known models: {', '.join(sorted(SHAPES))}") from None


def shape_from_config(config: object, name: str, source: str = "transformers config") -> ModelShape:
    """A `ModelShape` read from a transformers config (Llama-style attribute names; ``layer_types`` and
    ``sliding_window`` give the sliding layers of hybrid models; Gemma 3 has 4 norms per layer and q/k norms)."""
    q = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    types = list(getattr(config, "layer_types", None) or [])
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    mt = str(getattr(config, "model_type", ""))
    return ModelShape(
        name=name,
        layers=int(config.num_hidden_layers),
        q_heads=q,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or q),
        head_dim=int(getattr(config, "head_dim", None) or hidden // q),
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=mt.startswith(("qwen3", "gemma3")),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        source=source,
        sliding_layers=sliding,
        sliding_window=int(getattr(config, "sliding_window", 0) or 0) if sliding else 0,
        norms_per_layer=4 if mt.startswith("gemma3") else 2,
    )


def shape_to_dict(shape: ModelShape) -> dict[str, object]:
    """The shape as JSON-ready values (``sliding_layers`` as a list)."""
    from dataclasses import asdict

    d = asdict(shape)
    d["sliding_layers"] = list(shape.sliding_layers)
    return d


def shape_from_dict(d: dict[str, object]) -> ModelShape:
    """Inverse of `shape_to_dict` (a dict written before the sliding-layer fields existed still reads)."""
    d = dict(d)
    d["sliding_layers"] = tuple(d.get("sliding_layers", ()) or ())  # type: ignore[arg-type]
    return ModelShape(**d)  # type: ignore[arg-type]
