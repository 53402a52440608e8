"""Weight-only quantized matmul on GPU: one Triton-lowered Pallas kernel that dequantizes the
packed weight tile by tile inside the matmul, so the weight is read from memory packed.

Same contract as `weight_only_matmul_reference` (below; the model's reference path):
x [T, K] (bf16 / f16 / f32) times the weight held as `packed` [K / per, N] int32 (per = 32 / bits
values per word, packed along K, value j of word i is input row i * per + j), `scales` [G, N] and
`zeros` [G, N] in groups of `group_size` rows. Two forms of zero: unsigned integer zero points
(uint8; GPTQ, AWQ, compressed-tensors, GGUF Q8_0 / Q4_0 / Q5_0 / Q6_K), weight = (value - zero) *
scale, or, with `float_min`, a float minimum per group in the scales' dtype (GGUF Q4_1 / Q5_1 and
the K-quants Q4_K / Q5_K, whose blocks store a scaled minimum), weight = value * scale - zero.

Grid (T / block_m, N / block_n, K splits). A program walks its share of K in blocks of
min(group_size, 128) rows (each inside one group), and the splits' float32 partial sums are added
after the call. Per block it loads the block / per packed rows of its columns once, unpacks all
`per` values of each word at once ([block / per, per, block_n], whose leading axes merge into the
block's rows in order), dequantizes them with the group's scale and zero and multiplies with x's
columns of the block in one dot.

`weight_only_matmul_swapped` (below) is a second form for 4-bit groups of 128 with bf16 x at up to
64 rows: the operands swapped (out^T = W^T . x^T), so the weight is the dot's first operand.

Conversion: a value v (below 2^23) ORed into the bits of the float32 2^23 (0x4B000000) is the
float32 2^23 + v, so the unpacked integers become floats with an integer OR and a free bitcast, and
subtracting (zero + 2^23), computed once per group row, gives v - zero exactly (with a float
minimum, 2^23 is subtracted alone, then v * scale - minimum). An int-to-float
convert per value instead runs at a quarter of the integer rate on NVIDIA GPUs, and with the
bf16 convert after it the conversions bound the kernel (`magic=False` keeps that path for
comparison on the GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_K = 128  # rows of K per step at most: min(group_size, BLOCK_K) rows, one group's or less
TARGET_PROGRAMS = 264  # about two programs per SM of an H100 (132 SMs)
_pl_dot = getattr(plgpu, "dot", None) or pl.dot


def unpack_rows(packed: jax.Array, bits: int) -> jax.Array:
    """[K / (32 / bits), N] int32 -> [K, N] int32 unsigned values (lowest bits = first row)."""
    per = 32 // bits
    shifts = (jnp.arange(per, dtype=jnp.int32) * bits)[None, :, None]
    vals = (packed[:, None, :] >> shifts) & ((1 << bits) - 1)  # the mask drops the sign extension
    return vals.reshape(packed.shape[0] * per, packed.shape[1])


def dequantize_packed(packed: jax.Array, scales: jax.Array, zeros: jax.Array, bits: int, group_size: int,
                      dtype: jnp.dtype, float_min: bool = False) -> jax.Array:
    """The weight [K, N] in `dtype`, groups of `group_size` rows: (value - zero) * scale, or
    value * scale - zero with `float_min` (float32 arithmetic either way)."""
    vals = unpack_rows(packed, bits)
    k, n = vals.shape
    g = k // group_size
    v = vals.reshape(g, group_size, n).astype(jnp.float32)
    s, z = scales.astype(jnp.float32)[:, None, :], zeros.astype(jnp.float32)[:, None, :]
    w = v * s - z if float_min else (v - z) * s
    return w.reshape(k, n).astype(dtype)


def weight_only_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array,
                                 bits: int, group_size: int, float_min: bool = False) -> jax.Array:
    """x [T, K] @ dequant(packed [K / (32 / bits), N]) -> [T, N] in x's dtype.

    Reference path: unpack with shifts and masks, dequantize with the group scales and zeros in
    float32 (`dequantize_packed`), cast to x's dtype and run a plain matmul accumulating in
    float32. The GPU kernel takes this exact signature (contiguous groups along K, x already
    permuted for act-order)."""
    w = dequantize_packed(packed, scales, zeros, bits, group_size, x.dtype, float_min)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def block_k(group_size: int) -> int:
    """Rows of K per kernel step: a whole group up to BLOCK_K, else BLOCK_K (a divisor of it)."""
    return min(group_size, BLOCK_K)


def supported(t: int, k: int, n: int, bits: int, group_size: int, block_n: int = 128) -> bool:
    """Whether the kernel takes this shape (else callers use the reference): groups of 16, 32, 64
    or a multiple of 128 rows (16 is Triton's smallest dot depth), K a multiple of the group, N
    of `block_n`."""
    del t
    bk = block_k(group_size)
    return bits in (4, 8) and bk in (16, 32, 64, 128) and group_size % bk == 0 and k % group_size == 0 \
        and n % block_n == 0


MAGIC = 0x4B000000  # the float32 2^23: an integer below 2^23 in its low mantissa bits is exact


# 16-bit magic numbers (`post_scale`): a value v below 2^mantissa ORed into the bits of `base`
# is the 16-bit float base + v, exactly; so the unpacked integers become x's dtype with no
# arithmetic at all, and the dot runs on base + v.
HALF_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0, 7), jnp.dtype(jnp.float16): (0x6400, 1024.0, 10)}


def post_scale_ok(dtype, bits: int) -> bool:
    """Whether `post_scale` applies: x in bf16 (values up to 7 bits) or f16 (up to 10)."""
    spec = HALF_MAGIC.get(jnp.dtype(dtype))
    return spec is not None and bits <= spec[2]


def _group_rows(ref, g: int, gpb: int, rows: int) -> jax.Array:
    """float32 scales (or zeros) of the block starting in group g: [1, block_n] when the block lies
    in one group, else [rows, block_n] with each of its `gpb` groups' row repeated for its words."""
    t = ref[pl.ds(g, gpb), :].astype(jnp.float32)  # [gpb, block_n]
    if gpb == 1:
        return t
    return jnp.broadcast_to(t[:, None, :], (gpb, rows // gpb, t.shape[-1])).reshape(rows, t.shape[-1])


def _dequantize(ints: jax.Array, scale: jax.Array, zero: jax.Array, magic: bool, float_min: bool) -> jax.Array:
    """float32 weights of unsigned values: (v - zero) * scale, or v * scale - zero (`float_min`).
    `magic`: 2^23 + v as float32 bits, then minus 2^23 (exact), instead of a convert per value."""
    if magic:
        vals, offset = lax.bitcast_convert_type(ints | MAGIC, jnp.float32), float(1 << 23)
    else:
        vals, offset = ints.astype(jnp.float32), 0.0
    return (vals - offset) * scale - zero if float_min else (vals - (zero + offset)) * scale


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [block_m, k] . w [k, block_n] in float32 (full precision for float32 x)."""
    return _pl_dot(x, w, precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)


def _kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, bits: int, group_size: int, bk: int, steps: int, magic: bool,
            float_min: bool, post_scale: bool, slabs: bool):
    """One (row tile, column tile, K split): `steps` blocks of bk = min(group, 128) rows from
    split * steps on. Each block's words [bk / per, block_n] unpack at once into
    [bk / per, per, block_n] (value j of word i is row i * per + j, so merging the two leading axes
    gives the rows in order), are dequantized with the block's group scale and zero, and meet x in
    one dot of depth bk.

    `post_scale`: the block's values become base + v in x's 16-bit dtype by an OR alone
    (HALF_MAGIC), meet x in the dot as they are, and the group's scale and zero are applied to
    the dot's [block_m, block_n] sums instead of the [bk, block_n] weights: with xs the sum of x
    over the block's columns, x . w = (x . (base + v) - xs * (base + zero)) * scale, or with a
    float minimum (x . (base + v) - xs * base) * scale - xs * minimum.

    `slabs`: no [rows, per, block_n] tile and no reshape: value j of every word of the block (rows
    word * per + j) is its own [rows, block_n] slab, met in its own dot of depth rows by x's
    matching columns (x arrives with its columns permuted so that those are contiguous). A block
    may then span several groups (groups of 16-64 rows in 128-row blocks): word i's rows all lie in
    group i // (group_size / per), so one [rows, block_n] tile of scales (each group's row repeated
    group_size / per times) serves every slab of the block."""
    per = 32 // bits
    rows = bk // per
    mask = (1 << bits) - 1
    _, block_m, block_n = o_ref.shape
    first = pl.program_id(2) * steps
    shifts = (lax.broadcasted_iota(jnp.int32, (1, per, 1), 1) * bits)
    gpb = max(1, bk // group_size)  # groups in one block (more than one only with slabs)

    def body(kb, acc):
        words = p_ref[pl.ds(kb * rows, rows), :]  # [rows, block_n] int32
        g = (kb * bk) // group_size
        scale = _group_rows(s_ref, g, gpb, rows)  # [1 or rows, block_n]
        zero = _group_rows(z_ref, g, gpb, rows)
        if slabs:
            for j in range(per):
                w = _dequantize((words >> (j * bits)) & mask, scale, zero, magic, float_min)  # [rows, block_n]
                acc = acc + _dot(x_ref[:, pl.ds(kb * bk + j * rows, rows)], w.astype(x_ref.dtype))
            return acc
        ints = (words[:, None, :] >> shifts) & mask  # [rows, per, block_n]; the mask drops sign bits
        xb = x_ref[:, pl.ds(kb * bk, bk)]  # [block_m, bk]
        if post_scale:
            pattern, base, _ = HALF_MAGIC[jnp.dtype(x_ref.dtype)]
            w = lax.bitcast_convert_type((ints | pattern).astype(jnp.int16), x_ref.dtype).reshape(bk, block_n)
            xs = jnp.sum(xb.astype(jnp.float32), axis=1, keepdims=True)  # [block_m, 1]
            d = _pl_dot(xb, w)  # [block_m, block_n] float32: x . (base + v)
            if float_min:
                return acc + (d - xs * base) * scale - xs * zero
            return acc + (d - xs * (zero + base)) * scale
        w = _dequantize(ints, scale[None], zero[None], magic, float_min)
        return acc + _dot(xb, w.reshape(bk, block_n).astype(x_ref.dtype))

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc[None]


def pick_splits(programs: int, k_steps: int, target_programs: int | None = None) -> int:
    """K splits so that programs x splits reaches about `target_programs` (default
    TARGET_PROGRAMS): the largest divisor of the K steps not above target / programs (at least 1)."""
    want = max(1, -(-(target_programs or TARGET_PROGRAMS) // programs))
    return max(d for d in range(1, min(want, k_steps) + 1) if k_steps % d == 0)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "block_m", "block_n", "splits", "num_warps",
                                             "num_stages", "magic", "float_min", "post_scale", "slabs", "block_k_rows",
                                             "interpret"))
def weight_only_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array, *, bits: int,
                       group_size: int, block_m: int = 16, block_n: int = 128, splits: int | None = None,
                       num_warps: int = 4, num_stages: int = 2, magic: bool = True, float_min: bool = False,
                       post_scale: bool = False, slabs: bool = False, block_k_rows: int | None = None,
                       interpret: bool = False) -> jax.Array:
    """x [T, K] @ dequant(packed) -> [T, N] in x's dtype; shapes as in the module docstring.
    T is padded to a multiple of `block_m` (at least 16, Triton's smallest dot). `splits`: K is
    split over that many programs per output tile (default `pick_splits`: a narrow output at a
    small batch, o_proj or down_proj in decode, would otherwise occupy a fraction of the SMs);
    their float32 partial sums are added after the kernel. `post_scale` (x in bf16 with values of
    up to 7 bits, or f16 up to 10; `post_scale_ok`): scales and zeros applied to the dot's sums
    (see `_kernel`). `slabs`: one dot per value position of the words (see `_kernel`).
    `block_k_rows`: rows of K per step (a divisor of min(group, 128), at least 16 * 32 / bits
    with `slabs`); default min(group, 128)."""
    t, k = x.shape
    n = packed.shape[1]
    per = 32 // bits
    if not supported(t, k, n, bits, group_size, block_n):
        raise ValueError(f"weight_only_matmul kernel: unsupported shape T={t} K={k} N={n} bits={bits} "
                         f"group_size={group_size} (groups of 16, 32, 64 or a multiple of {BLOCK_K} rows, "
                         f"K a multiple of the group, N of {block_n})")
    if packed.shape != (k // per, n) or scales.shape != (k // group_size, n) or zeros.shape != scales.shape:
        raise ValueError(f"weight_only_matmul kernel: packed {packed.shape}, scales {scales.shape}, zeros "
                         f"{zeros.shape} do not fit K={k}, N={n}, {bits} bits, groups of {group_size}")
    if post_scale and not post_scale_ok(x.dtype, bits):
        raise ValueError(f"weight_only_matmul kernel: post_scale needs x in bfloat16 (values of up to 7 bits) or "
                         f"float16 (up to 10), got {x.dtype} with {bits}-bit values")
    tp = -(-t // block_m) * block_m
    xp = jnp.pad(x, ((0, tp - t), (0, 0)))
    g = k // group_size
    # slabs: 128-row blocks even for smaller groups (several groups a block), so loads stay large
    bk = block_k_rows or (BLOCK_K if slabs and BLOCK_K % group_size == 0 else block_k(group_size))
    inside = block_k(group_size) % bk == 0  # each block inside one group
    spans = slabs and bk % group_size == 0 and group_size % per == 0  # whole groups in each block
    if not (inside or spans) or bk < 16 or (slabs and (bk // per < 16 or post_scale)):
        raise ValueError(f"weight_only_matmul kernel: {bk} rows per step do not fit groups of {group_size}"
                         f"{' with slabs (16 words a slab at least, no post_scale)' if slabs else ''}")
    if slabs:  # x's columns in the order of the slabs: step, value position j, word
        xp = xp.reshape(tp, k // bk, bk // per, per).swapaxes(2, 3).reshape(tp, k)
    k_steps = k // bk
    splits = splits or pick_splits((tp // block_m) * (n // block_n), k_steps)
    if k_steps % splits:
        raise ValueError(f"weight_only_matmul kernel: {splits} splits do not divide {k_steps} steps of {bk} rows")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    sums = pl.pallas_call(
        functools.partial(_kernel, bits=bits, group_size=group_size, bk=bk, steps=k_steps // splits, magic=magic,
                          float_min=float_min, post_scale=post_scale, slabs=slabs),
        grid=(tp // block_m, n // block_n, splits),
        in_specs=[pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((k // per, block_n), lambda i, j, s: (0, j)),
                  pl.BlockSpec((g, block_n), lambda i, j, s: (0, j)),
                  pl.BlockSpec((g, block_n), lambda i, j, s: (0, j))],
        out_specs=pl.BlockSpec((1, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tp, n), jnp.float32),
        interpret=interpret, name="weight_only_matmul", **kwargs,
    )(xp, packed, scales, zeros)
    return sums.sum(0)[:t].astype(x.dtype)


# -- the swapped form: out^T = W^T . x^T, the weight as the dot's first operand ----------------
#
# At a decode step's few rows the kernel above leaves the weight as the dot's second operand, which
# an MMA reads in its own layout, so the dequantized bf16 tile is moved between threads (the
# reason this form was tried; its PTX was not read). Swapped, the weight's output columns
# are the MMA's 64-row side and the tokens its narrow side; a step is one group of 128 rows of K
# (16 words a column), unpacked into 8 slabs as in `slabs` (value position j of every word, met by
# x's matching 16 columns), each slab converted by one shift and one lop3 per pair of values
# (value positions j and j + 4 share a 32-bit register as the two bf16 halves 128 + v, exactly),
# and the group's scale and zero applied to the step's [block_n, T] sums:
#     sum_k x (v - z) s = s (sum_k x (128 + v) - (128 + z) sum_k x).
# Interpret mode (no inline PTX) computes the same values with shifts, masks and ORs.

SWAPPED_BLOCK_N = 128
# (w >> 4j) & 0x000F000F | 0x43004300 holds bf16 128 + v_j (low half) and 128 + v_{j+4} (high
# half); lop3's table 0xEA is (a & b) | c. One asm block a half: Pallas lowers one result per
# inline-asm call (ptxas may share the shift and lop3 of a pair).
_LOP3 = ("{ .reg .b32 t; .reg .b16 u; shr.b32 t, $1, %d; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
         "mov.b32 %s, t; }")


def swapped_supported(t: int, k: int, n: int, bits: int, group_size: int, dtype, float_min: bool) -> bool:
    """Whether `weight_only_matmul_swapped` takes the call: 4-bit values with integer zero points in
    groups of 128, x in bf16, at most 64 rows, N a multiple of SWAPPED_BLOCK_N."""
    return (bits == 4 and group_size == 128 and not float_min and jnp.dtype(dtype) == jnp.bfloat16 and t <= 64
            and k % 128 == 0 and n % SWAPPED_BLOCK_N == 0)


def swapped_splits(programs: int, groups: int) -> int:
    """K splits of the swapped form: twice `pick_splits`' where that divides the groups (shorter K
    loops, more programs in flight: the faster setting on the H100 for every Llama-3-8B linear at
    16 rows, benchmarks/results/weight_only_h100.md)."""
    splits = pick_splits(programs, groups)
    return 2 * splits if groups % (2 * splits) == 0 else splits


def _slab_pair(words: jax.Array, j: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """bf16 128 + v of value positions j and j + 4 (j < 4) of every word."""
    if interpret:
        return tuple(lax.bitcast_convert_type((((words >> (4 * i)) & 15) | 0x4300).astype(jnp.int16), jnp.bfloat16)
                     for i in (j, j + 4))
    shape = jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)
    return tuple(plgpu.elementwise_inline_asm(_LOP3 % (4 * j, halves), args=[words], constraints="=h,r", pack=1,
                                              result_shape_dtypes=[shape])[0]
                 for halves in ("{$0, u}", "{u, $0}"))


def _swapped_kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, steps: int, interpret: bool):
    """One (column tile, K split): `steps` groups from split * steps on; x_ref is x^T with each
    group's columns in slab order (value position j, then word), p_ref the [K / 8, block_n] words."""
    _, block_n, tp = o_ref.shape
    first = pl.program_id(1) * steps

    def body(g, acc):
        words = p_ref[pl.ds(g * 16, 16), :].T  # [block_n, 16]: column n's 16 words of group g
        d = jnp.zeros((block_n, tp), jnp.float32)
        xs = jnp.zeros((1, tp), jnp.float32)
        for j in range(4):
            for jj, a in zip((j, j + 4), _slab_pair(words, j, interpret)):
                xb = x_ref[pl.ds(g * 128 + jj * 16, 16), :]  # [16, T]: x's columns 8 i + jj of the group
                d = d + _pl_dot(a, xb)
                xs = xs + jnp.sum(xb.astype(jnp.float32), axis=0, keepdims=True)
        scale = s_ref[g, :].astype(jnp.float32)[:, None]  # [block_n, 1]
        zero = z_ref[g, :].astype(jnp.float32)[:, None]
        return acc + scale * (d - (zero + 128.0) * xs)

    acc = lax.fori_loop(first, first + steps, body, jnp.zeros((block_n, tp), jnp.float32))
    o_ref[...] = acc[None]


@functools.partial(jax.jit, static_argnames=("splits", "num_warps", "num_stages", "interpret"))
def weight_only_matmul_swapped(x: jax.Array, packed: jax.Array, scales: jax.Array, zeros: jax.Array, *,
                               splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
                               interpret: bool = False) -> jax.Array:
    """x [T, K] bf16 @ dequant(packed [K / 8, N] int4 words, scales / zeros [K / 128, N]) -> [T, N]
    bf16, the same contract as `weight_only_matmul` with bits=4, group_size=128 and integer zero
    points (`swapped_supported`); the swapped form above. `splits`: K splits (default
    `swapped_splits`), their float32 partial sums added after the call."""
    t, k = x.shape
    n = packed.shape[1]
    if not swapped_supported(t, k, n, 4, 128, x.dtype, False):
        raise ValueError(f"weight_only_matmul_swapped: unsupported call T={t} K={k} N={n} x {x.dtype} "
                         f"(bf16 x, at most 64 rows, K a multiple of 128, N of {SWAPPED_BLOCK_N})")
    g = k // 128
    if packed.shape != (k // 8, n) or scales.shape != (g, n) or zeros.shape != (g, n):
        raise ValueError(f"weight_only_matmul_swapped: packed {packed.shape}, scales {scales.shape}, zeros "
                         f"{zeros.shape} do not fit K={k}, N={n}, 4 bits, groups of 128")
    tp = max(16, -(-t // 16) * 16)
    # x^T [K, tp], each group's columns in slab order: position g * 128 + j * 16 + i holds column
    # g * 128 + 8 i + j
    xt = jnp.pad(x, ((0, tp - t), (0, 0))).reshape(tp, g, 16, 8).swapaxes(2, 3).reshape(tp, k).T
    splits = splits or swapped_splits(n // SWAPPED_BLOCK_N, g)
    if g % splits:
        raise ValueError(f"weight_only_matmul_swapped: {splits} splits do not divide {g} groups")
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    bn = SWAPPED_BLOCK_N
    sums = pl.pallas_call(
        functools.partial(_swapped_kernel, steps=g // splits, interpret=interpret),
        grid=(n // bn, splits),
        in_specs=[pl.BlockSpec((k, tp), lambda i, s: (0, 0)),
                  pl.BlockSpec((k // 8, bn), lambda i, s: (0, i)),
                  pl.BlockSpec((g, bn), lambda i, s: (0, i)),
                  pl.BlockSpec((g, bn), lambda i, s: (0, i))],
        out_specs=pl.BlockSpec((1, bn, tp), lambda i, s: (s, i, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
        interpret=interpret, name="weight_only_matmul_t", **kwargs,
    )(xt, packed, scales, zeros)
    return sums.sum(0)[:, :t].T.astype(x.dtype)


__all__ = ["block_k", "dequantize_packed", "pick_splits", "post_scale_ok", "supported", "swapped_splits", "swapped_supported",
           "unpack_rows", "weight_only_matmul", "weight_only_matmul_reference", "weight_only_matmul_swapped"]
