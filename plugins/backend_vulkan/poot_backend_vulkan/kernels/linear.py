"""y = x W^T and embedding gathers over any supported weight format."""

from __future__ import annotations

from poot_core.errors import Reason, Unsupported

from .runtime import MAX_GROUPS, Batch, DeviceArray, Runtime, grid_1d, pack_params, shader_source
from .shapes import check
from .weights import DeviceWeight

_TOKENS_PER_GROUP = 4  # must match TOKENS in linear.wgsl
_GEMV_ROWS = 4  # must match ROWS in gemv.wgsl
GEMV_FORMATS = {"bf16": 8, "f16": 8, "f32": 4}  # dense formats with a one-token shader: values per 16 bytes
UNIT_VALUES = 32  # a packed GEMV's step: one 32-value unit (gemv_units.wgsl, each layout's dot_<fmt>.wgsl)
# split-K: below this many row workgroups a GEMV's rows are also cut along K (not yet tuned on a GPU)
SPLITK_GROUPS = 2048
MAX_SPLITK = 8
GATED_ACTS = ("silu", "gelu_tanh")  # activations gemv(gated=) applies (activations.wgsl)


def _pipeline(batch: Batch, kernel: str, weight: DeviceWeight, bias: bool = False, one_token: bool = False):
    source = shader_source(kernel, "bytes", *weight.fmt.sources())
    variant = "bias" if bias else ""
    if bias:
        source = source.replace("//BIAS ", "")
    if one_token:  # a decode step of a packed format: each unit's products for one token, not four
        source = source.replace("const TOKENS: u32 = 4u;", "const TOKENS: u32 = 1u;")
        variant += ":one"
    return batch.runtime.pipeline(f"{kernel}:{weight.fmt.name}", source, variant)


def linear(
    batch: Batch, x: DeviceArray, weight: DeviceWeight, out: DeviceArray, bias: DeviceArray | None = None
) -> None:
    """out[T, N] = x[T, K] @ W[N, K]^T (+ bias[N]); one dispatch per row-chunk of W."""
    tokens = x.size // weight.cols
    check("linear.x", x, (tokens, weight.cols))
    check("linear.out", out, (tokens, weight.rows))
    if bias is not None:
        check("linear.bias", bias, (weight.rows,))
    if tokens == 1 and has_gemv(weight):
        gemv(batch, x, weight, out, bias)
        return
    pipeline = _pipeline(batch, "linear", weight, bias is not None, one_token=tokens == 1)
    token_groups = -(-tokens // _TOKENS_PER_GROUP)
    if token_groups > MAX_GROUPS:
        raise Unsupported(Reason.SHAPE, "linear", f"{tokens} tokens exceed one dispatch")
    for chunk in weight.chunks:
        gx = min(chunk.rows, MAX_GROUPS)
        gz = -(-chunk.rows // gx)
        params = pack_params(chunk.rows, weight.cols, chunk.row_start, weight.rows, tokens, chunk.first_row)
        buffers = [chunk.buffer, x.buffer, out.buffer] + ([] if bias is None else [bias.buffer])
        batch.dispatch(pipeline, buffers, params, (gx, token_groups, gz))


def has_gemv(weight: DeviceWeight) -> bool:
    """Whether gemv() takes this matrix: a dense format with whole 16-byte words a row, or any packed layout."""
    per_word = GEMV_FORMATS.get(weight.fmt.name)
    return weight.fmt.block_values > 1 or (per_word is not None and weight.cols % per_word == 0)


def _gemv_source(weight: DeviceWeight) -> tuple[str, int, int]:
    """(shader source, values per step of a row's threads, fewest steps per split-K range) of a format."""
    name = weight.fmt.name
    if name in GEMV_FORMATS:
        return shader_source("gemv", "gemv_words", f"gemv_{name}"), GEMV_FORMATS[name], 256
    return shader_source("gemv", "gemv_units", "bytes", *weight.fmt.helpers, f"dot_{name.lower()}"), UNIT_VALUES, 128


def gemv(
    batch: Batch,
    x: DeviceArray,
    weight: DeviceWeight,
    out: DeviceArray | list[DeviceArray],
    bias: DeviceArray | None = None,
    subgroups: bool | None = None,
    warp: bool | None = None,
    splits: int | None = None,
    gated: str | None = None,
    partials: bool = False,
) -> None:
    """out[N] = W[N, K] @ x[K] (+ bias) for one token (gemv.wgsl): dense weights read as 16-byte words, GGUF
    blocks a 32-value unit per thread and step.

    `out` may be a list of up to three arrays whose sizes add up to N: consecutive row ranges of W go to
    each (a q/k/v or gate/up concatenation in one dispatch; no bias then).
    subgroups: reduce with subgroupAdd (None: when the runtime's subgroups have at most 64 lanes); with
    subgroups of exactly 32 lanes a row is one subgroup (WARP), unless `warp` is False.
    splits: cut each row's K into this many ranges, summed by a combine pass (None: split_count).
    gated: an activation of GATED_ACTS: W is a gate/up concatenation (gate rows, then as many up rows, in one
    binding) and out[N / 2] = act(gate) * up, the products themselves never stored (one output, no bias).
    partials: with splits > 1, out's buffer holds [splits, N] and gets the partial sums, added by its reader
    (norms.rms_norm's residual_splits) instead of a combine pass (one output, no bias, not gated)."""
    if not has_gemv(weight):
        raise Unsupported(Reason.SHAPE, "gemv", f"{weight.fmt.name} rows of {weight.cols} values")
    outs = list(out) if isinstance(out, list) else [out]
    if not 1 <= len(outs) <= 3 or (len(outs) > 1 and bias is not None):
        raise Unsupported(Reason.SHAPE, "gemv", "one to three outputs, a bias only with one")
    if gated is not None and (gated not in GATED_ACTS or len(outs) > 1 or bias is not None or weight.rows % 2
                              or len(weight.chunks) > 1):
        raise Unsupported(Reason.SHAPE, f"gemv gated {gated}",
                          f"one output, no bias, an even row count in one binding, an activation of {GATED_ACTS}")
    if partials and (len(outs) > 1 or bias is not None or gated is not None):
        raise Unsupported(Reason.SHAPE, "gemv partials", "one output, no bias, not gated")
    check("gemv.x", x, (1, weight.cols))
    sizes = [o.size for o in outs]
    if gated is not None:
        sizes = [2 * sizes[0]]
    if sum(sizes) != weight.rows:
        raise Unsupported(Reason.SHAPE, "gemv.out", f"outputs of {sizes} values for {weight.rows} rows")
    if bias is not None:
        check("gemv.bias", bias, (weight.rows,))
    flag, rows_per_group = _reduction(batch.runtime, subgroups, warp)
    source, per_word, min_span = _gemv_source(weight)
    source = source.replace(f"//{flag} ", "")
    if flag == "WARP":
        source = source.replace("const ROWS: u32 = 4u;", f"const ROWS: u32 = {rows_per_group}u;")
        source = source.replace("const LANES: u32 = 64u;", "const LANES: u32 = 32u;")
    words = weight.cols // per_word
    if splits is None:
        splits = split_count(-(-weight.rows // rows_per_group), words, min_span)
    if partials and outs[0].buffer.size < 4 * splits * weight.rows:
        raise Unsupported(Reason.SHAPE, "gemv partials", f"a buffer of {splits} x {weight.rows} values")
    if not 1 <= splits <= MAX_GROUPS:
        raise Unsupported(Reason.SHAPE, "gemv", f"{splits} splits of a row")
    span = -(-words // splits)
    split1 = sizes[0] if len(outs) > 1 else weight.rows // 2 if gated else weight.rows
    split2 = sizes[0] + sizes[1] if len(outs) > 2 else weight.rows  # past every row: no third output
    if len(outs) == 2:  # the third binding exists in the shaders; a scratch word stands in
        outs.append(DeviceArray(batch.runtime.scratch("gemv_unused", 16), (4,)))
    tail = [] if bias is None else [bias.buffer]
    tail += [o.buffer for o in outs[1:]]
    variant = flag
    if splits > 1:  # partial sums to a scratch buffer, then one combine pass writes the outputs
        source, variant = source.replace("//SPLITK ", ""), variant + ":splitk"
        target = outs[0].buffer if partials else batch.runtime.scratch("gemv_partial", 4 * splits * weight.rows)
        extra = []
    else:
        source, variant = _flags(source, variant, bias is not None, len(outs) > 1, gated)
        target, extra = outs[0].buffer, tail
    pipeline = batch.runtime.pipeline(f"gemv:{weight.fmt.name}", source, variant)
    for chunk in weight.chunks:
        params = pack_params(chunk.rows, weight.cols, chunk.row_start, chunk.first_row, split1, split2, span,
                             weight.rows)
        gx, gy, _ = grid_1d(-(-chunk.rows // rows_per_group))
        batch.dispatch(pipeline, [chunk.buffer, x.buffer, target, *extra], params, (gx, gy, splits))
    if splits > 1 and not partials:
        source, variant = _flags(shader_source("gemv_combine"), "", bias is not None, len(outs) > 1, gated)
        combine = batch.runtime.pipeline("gemv_combine", source, variant)
        batch.dispatch(combine, [target, outs[0].buffer, *tail], pack_params(weight.rows, splits, split1, split2),
                       grid_1d(-(-weight.rows // 64)))


def _reduction(runtime: Runtime, subgroups: bool | None, warp: bool | None) -> tuple[str, int]:
    """(the gemv shader's reduction flag: TREE, SUBGROUP or WARP, rows per workgroup) for these choices (None:
    the runtime's default)."""
    use_subgroups = runtime.gemv_subgroups if subgroups is None else subgroups
    if use_subgroups and not runtime.has_subgroups:
        raise Unsupported(Reason.OPERATION, "gemv subgroups", "the device has no subgroup feature")
    use_warp = use_subgroups and (runtime.subgroup_width == 32 if warp is None else warp)
    if use_warp and runtime.subgroup_width != 32:
        raise Unsupported(Reason.OPERATION, "gemv warp", "the device's subgroups are not 32 lanes")
    if use_warp:
        return "WARP", 256 // 32
    return ("SUBGROUP" if use_subgroups else "TREE"), _GEMV_ROWS


def gemv_splits(runtime: Runtime, weight: DeviceWeight) -> int:
    """The split-K count gemv chooses for this matrix with the runtime's default reduction."""
    _, rows_per_group = _reduction(runtime, None, None)
    _, per_word, min_span = _gemv_source(weight)
    return split_count(-(-weight.rows // rows_per_group), weight.cols // per_word, min_span)


def _flags(source: str, variant: str, bias: bool, split: bool, gated: str | None = None) -> tuple[str, str]:
    """Enable a gemv shader's BIAS, SPLIT (several outputs) or GATED (act(gate) * up, `gated` the act) lines."""
    if bias:
        source, variant = source.replace("//BIAS ", ""), variant + ":bias"
    if split:
        source, variant = source.replace("//SPLIT ", ""), variant + ":split"
    if gated:
        source = source.replace("//GATED ", "") + shader_source("activations")
        source += f"\nfn gate_act(v: f32) -> f32 {{ return {gated}(v); }}\n"
        variant += f":gated_{gated}"
    return source, variant


def split_count(row_groups: int, words: int, min_span: int = 256) -> int:
    """Split-K for a GEMV with few row groups and long rows: enough workgroups to fill a large GPU
    (SPLITK_GROUPS), each split at least `min_span` words of a row (4 x 64 16-byte words dense, 2 x 64 units
    packed); 1 when the rows alone give enough."""
    if row_groups >= SPLITK_GROUPS:
        return 1
    return max(1, min(SPLITK_GROUPS // row_groups, words // min_span, MAX_SPLITK))


def embed(batch: Batch, table: DeviceWeight, ids: DeviceArray, out: DeviceArray, scale: float = 1.0) -> None:
    """out[T, K] = scale * table[ids[t], :] widened to f32; one dispatch per row-chunk of the table.

    Ids outside the table leave their output row untouched (the caller validates token ids).
    """
    tokens = ids.size
    check("embed.ids", ids, (tokens,), "u32")
    check("embed.out", out, (tokens, table.cols))
    pipeline = _pipeline(batch, "embed", table)
    units = -(-table.cols // 32)
    for chunk in table.chunks:
        params = pack_params(chunk.rows, table.cols, chunk.row_start, table.cols, tokens, float(scale))
        batch.dispatch(pipeline, [chunk.buffer, ids.buffer, out.buffer], params, grid_1d(-(-tokens * units // 64)))
