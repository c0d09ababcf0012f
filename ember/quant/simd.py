"""16-lane vector primitives for the matrix-vector kernels, written as LLVM IR (numba intrinsics).

Each primitive takes 16 quantized values from a row's bytes, turns them into float32 lanes and adds
`scale · value · x` to 16 float32 accumulators `acc[acc_at : acc_at+16]`:

    acc[acc_at + i] += scale · q[i] · x[x_at + i]        for i in 0…15

The callers spread consecutive primitives over several such banks (`kernels.ACC_LANES`), so that
each addition does not wait for the one before it (one bank: a chain of dependent adds per row).

Why IR and not numba loops: LLVM vectorizes numba's loops over a 16- or 32-value block poorly (it
unrolls constant trip counts into scalar code, and checks for aliasing at run time on every block).
Measured on one thread (2026-12-01), SmolLM2's 1536×576 Q4_1 matrix: 230 µs as a numba loop, 60 µs with
these primitives (15 G values/s); Gemma 3's 640×1024 Q4_K: 200 µs → 80 µs.

The values are exact small integers (or f16/bf16 values) and the products are formed in float32:
the kernels compute the same Σ (scale·q)·x as multiplying by the dequantized matrix, in another order.
"""

from __future__ import annotations

from llvmlite import ir

from ember.quant.jit import cgutils, intrinsic, types

LANES = 16


def has_cpu_flag(flag: str) -> bool:
    """Whether this CPU lists `flag` (Linux's /proc/cpuinfo flags; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and flag in line.split() for line in info)
    except OSError:
        return False


def has_avx512() -> bool:
    """Whether this CPU has AVX-512."""
    return has_cpu_flag("avx512f")


AVX512 = has_avx512()
# The lanes of the few-rows product's register block (`_dot_block`): 2 weight rows × 4 rows of x are 8
# accumulators, 2 weight and 4 x vectors. In 16 lanes they fit AVX-512's 32 registers; with AVX2's 16
# registers of 8 lanes they take 28 and spill, so there the block works in 8 lanes (14 registers).
# Measured on a 2-core AMD EPYC with AVX2 (Zen 3, 2026-12-07, SmolLM2's Q4_1 matrices, one thread, best
# of 1000, two runs each): qkv 960×576 at 8 / 15 rows 321-469 / 461-664 µs in 16 lanes, 238-239 /
# 377-384 in 8; gate_up 3072×576 1016-1532 / 1459-2122 against 746-752 / 1194-1211.
DOT_LANES = LANES if AVX512 else 8
_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


_ONE = ir.Constant(_F32, 1.0)
# Lets LLVM fuse a product and the sum it feeds into one multiply-add (one rounding instead of two).
_CONTRACT = ("contract",)


def _canonical(context, builder, sig, args):
    """Arguments as the IR expects them: indices and integers as int64, scales as float32."""
    out = []
    for value, kind in zip(args, sig.args, strict=True):
        if isinstance(kind, types.Integer):
            value = context.cast(builder, value, kind, types.int64)
        elif isinstance(kind, types.Float):
            value = context.cast(builder, value, kind, types.float32)
        out.append(value)
    return out


def _vector(element: ir.Type) -> ir.VectorType:
    return ir.VectorType(element, LANES)


def _lanes(context, builder, array_type, array, index, element: ir.Type):
    """Pointer to LANES elements of `element` type starting at array[index] (an element index)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), ir.PointerType(_vector(element)))


def _splat(builder, value, element: ir.Type = _F32):
    vector = builder.insert_element(ir.Constant(_vector(element), ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vector, ir.Constant(_vector(element), ir.Undefined),
                                  ir.Constant(_vector(_I32), [0] * LANES))


def _accumulate(context, builder, acc_type, acc, acc_at, x_type, x, x_at, values, scale) -> None:
    """acc[acc_at:acc_at+16] += values · x[x_at:x_at+16] · scale (values: a float vector)."""
    acc_pointer = _lanes(context, builder, acc_type, acc, acc_at, _F32)
    x_lanes = builder.load(_lanes(context, builder, x_type, x, x_at, _F32), align=4)
    product = builder.fmul(builder.fmul(values, x_lanes), _splat(builder, scale))
    builder.store(builder.fadd(builder.load(acc_pointer, align=4), product), acc_pointer, align=4)


def _bytes(context, builder, src_type, src, at):
    """16 bytes of src from byte `at`, zero-extended to 32-bit lanes."""
    return builder.zext(_byte_lanes(context, builder, src_type, src, at), _vector(_I32))


def _byte_lanes(context, builder, src_type, src, at):
    """16 bytes of src from byte `at`, as a vector of 16 bytes (bit work on bytes: one 128-bit register
    where 32-bit lanes take four)."""
    return builder.load(_lanes(context, builder, src_type, src, at, _I8), align=1)


def _const(value: int):
    return ir.Constant(_vector(_I32), [value] * LANES)


def _int_splat(builder, value):
    """An int64 value, truncated to 32 bits, in every lane."""
    return _splat(builder, builder.trunc(value, _I32), _I32)


def _floats(builder, integers):
    return builder.uitofp(integers, _vector(_F32))


@intrinsic
def fma_nibbles(typingctx, acc, acc_at, src, at, x, low_at, high_at, low_scale, high_scale):
    """acc[acc_at+i] += low_scale · (src[at+i] & 15) · x[low_at+i];
    acc[acc_at+16+i] += high_scale · (src[at+i] >> 4) · x[high_at+i]."""
    signature = types.void(acc, acc_at, src, at, x, low_at, high_at, low_scale, high_scale)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        acc_v, acc_at_v, src_v, at_v, x_v, low_v, high_v, low_s, high_s = args
        acc_t, _, src_t, _, x_t = sig.args[:5]
        q = _bytes(context, builder, src_t, src_v, at_v)
        low = _floats(builder, builder.and_(q, _const(15)))
        high = _floats(builder, builder.lshr(q, _const(4)))
        _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, low_v, low, low_s)
        high_acc = builder.add(acc_at_v, ir.Constant(_I64, LANES))
        _accumulate(context, builder, acc_t, acc_v, high_acc, x_t, x_v, high_v, high, high_s)
        return context.get_dummy_value()

    return signature, codegen


def _e2m1_doubled(builder, nibbles):
    """Twice the e2m1 value of each 4-bit code (sign, 2 exponent bits, 1 mantissa bit) as int32 lanes:
    codes 0…7 → 0, 1, 2, 3, 4, 6, 8, 12 ((2 + m) << (e − 1) from e = 1 on), bit 3 the sign (gguf-py's
    MXFP4 `kvalues`)."""
    code = builder.and_(nibbles, _const(7))
    exponent = builder.lshr(code, _const(1))
    mantissa = builder.and_(code, _const(1))
    normal = builder.lshr(builder.shl(builder.add(mantissa, _const(2)), exponent), _const(1))
    magnitude = builder.select(builder.icmp_unsigned("<", code, _const(2)), code, normal)
    negative = builder.icmp_unsigned("!=", builder.and_(nibbles, _const(8)), _const(0))
    return builder.select(negative, builder.sub(_const(0), magnitude), magnitude)


@intrinsic
def fma_e2m1(typingctx, acc, acc_at, src, at, x, low_at, high_at, scale):
    """acc[acc_at+i] += scale · e2m1(src[at+i] & 15) · x[low_at+i];
    acc[acc_at+16+i] += scale · e2m1(src[at+i] >> 4) · x[high_at+i], e2m1 doubled as gguf-py's
    MXFP4 values are (the scale being half the block's e8m0 power of two)."""
    signature = types.void(acc, acc_at, src, at, x, low_at, high_at, scale)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        acc_v, acc_at_v, src_v, at_v, x_v, low_v, high_v, scale_v = args
        acc_t, _, src_t, _, x_t = sig.args[:5]
        q = _bytes(context, builder, src_t, src_v, at_v)
        low = builder.sitofp(_e2m1_doubled(builder, builder.and_(q, _const(15))), _vector(_F32))
        high = builder.sitofp(_e2m1_doubled(builder, builder.lshr(q, _const(4))), _vector(_F32))
        _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, low_v, low, scale_v)
        high_acc = builder.add(acc_at_v, ir.Constant(_I64, LANES))
        _accumulate(context, builder, acc_t, acc_v, high_acc, x_t, x_v, high_v, high, scale_v)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def decode_nibbles(typingctx, dst, low_at, high_at, src, at, low_scale, low_min, high_scale, high_min):
    """dst[low_at+i] = low_scale · (src[at+i] & 15) − low_min;
    dst[high_at+i] = high_scale · (src[at+i] >> 4) − high_min, for i < 16: a K-quant's nibbles decoded
    into memory (prefill's tiles), each value one float32 product and one subtraction, as ggml's
    dequantize_row_q4_K rounds them (no fused multiply-add). Decoding the 1B's 256 × 2048 Q4_K tiles
    (one Xeon core): 6.0 G values/s as a numba loop, 7.6 with this; Q6_K (`decode_six_bits`) 4.9 → 5.5."""
    signature = types.void(dst, low_at, high_at, src, at, low_scale, low_min, high_scale, high_min)

    def codegen(context, builder, sig, args):
        dst_v, low_at_v, high_at_v, src_v, at_v, low_s, low_m, high_s, high_m = _canonical(
            context, builder, sig, args)
        q = _bytes(context, builder, sig.args[3], src_v, at_v)
        for nibbles, where, scale, minimum in ((builder.and_(q, _const(15)), low_at_v, low_s, low_m),
                                               (builder.lshr(q, _const(4)), high_at_v, high_s, high_m)):
            values = builder.fsub(builder.fmul(_splat(builder, scale), _floats(builder, nibbles)),
                                  _splat(builder, minimum))
            _store_floats(context, builder, sig.args[0], dst_v, where, values)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def decode_six_bits(typingctx, dst, dst_at, src, low_at, high_at, s1, s2, s3, s4):
    """16 columns of a Q6_K half-block into memory: with l1 = src[low_at+i], l2 = src[low_at+32+i] and
    h = src[high_at+i], dst[dst_at+i] = s1 · ((l1 & 15 | (h & 3) << 4) − 32), dst[dst_at+32+i] = s2 ·
    ((l2 & 15 | (h >> 2 & 3) << 4) − 32), dst[dst_at+64+i] = s3 · ((l1 >> 4 | (h >> 4 & 3) << 4) − 32),
    dst[dst_at+96+i] = s4 · ((l2 >> 4 | (h >> 6) << 4) − 32), as ggml's dequantize_row_q6_K."""
    signature = types.void(dst, dst_at, src, low_at, high_at, s1, s2, s3, s4)

    def codegen(context, builder, sig, args):
        dst_v, dst_at_v, src_v, low_v, high_v, s1_v, s2_v, s3_v, s4_v = _canonical(
            context, builder, sig, args)
        src_t = sig.args[2]
        l1 = _bytes(context, builder, src_t, src_v, low_v)
        l2 = _bytes(context, builder, src_t, src_v, builder.add(low_v, _i64(32)))
        h = _bytes(context, builder, src_t, src_v, high_v)
        quarters = ((builder.and_(l1, _const(15)), 0, s1_v), (builder.and_(l2, _const(15)), 2, s2_v),
                    (builder.lshr(l1, _const(4)), 4, s3_v), (builder.lshr(l2, _const(4)), 6, s4_v))
        for k, (low, shift, scale) in enumerate(quarters):
            top = builder.shl(builder.and_(builder.lshr(h, _const(shift)), _const(3)), _const(4))
            value = builder.sub(builder.or_(low, top), _const(32))
            floats = builder.sitofp(value, _vector(_F32))
            _store_floats(context, builder, sig.args[0], dst_v, builder.add(dst_at_v, _i64(32 * k)),
                          builder.fmul(_splat(builder, scale), floats))
        return context.get_dummy_value()

    return signature, codegen


def _five_bit_pair(context, builder, sig, args, low_fifth, high_fifth) -> None:
    """The shared end of the two fma_nibbles_* primitives: nibbles with their fifth bits (0/1 lanes)."""
    acc_v, acc_at_v, src_v, at_v = args[:4]
    x_v, low_v, high_v, low_s, high_s = args[-5:]
    acc_t, _, src_t = sig.args[:3]
    x_t = sig.args[-5]
    q = _bytes(context, builder, src_t, src_v, at_v)
    low = builder.or_(builder.and_(q, _const(15)), builder.shl(low_fifth, _const(4)))
    high = builder.or_(builder.lshr(q, _const(4)), builder.shl(high_fifth, _const(4)))
    _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, low_v, _floats(builder, low), low_s)
    high_acc = builder.add(acc_at_v, ir.Constant(_I64, LANES))
    _accumulate(context, builder, acc_t, acc_v, high_acc, x_t, x_v, high_v, _floats(builder, high), high_s)


@intrinsic
def fma_nibbles_word_bits(typingctx, acc, acc_at, src, at, word, x, low_at, high_at, low_scale, high_scale):
    """As fma_nibbles with fifth bits from a 32-bit word (Q5_0, Q5_1): lane i's low value is
    (src[at+i] & 15) | bit i of word << 4, its high value (src[at+i] >> 4) | bit 16+i << 4."""
    signature = types.void(acc, acc_at, src, at, word, x, low_at, high_at, low_scale, high_scale)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        word = _int_splat(builder, args[4])
        lanes = ir.Constant(_vector(_I32), list(range(LANES)))
        low_fifth = builder.and_(builder.lshr(word, lanes), _const(1))
        high_fifth = builder.and_(builder.lshr(word, builder.add(lanes, _const(16))), _const(1))
        _five_bit_pair(context, builder, sig, args, low_fifth, high_fifth)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def fma_signed_bytes(typingctx, acc, acc_at, src, at, x, x_at, scale):
    """acc += scale · int8(src[at+i]) · x[x_at+i] (Q8_0)."""
    signature = types.void(acc, acc_at, src, at, x, x_at, scale)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        acc_v, acc_at_v, src_v, at_v, x_v, x_at_v, scale_v = args
        acc_t, _, src_t, _, x_t = sig.args[:5]
        q = builder.load(_lanes(context, builder, src_t, src_v, at_v, _I8), align=1)
        values = builder.sitofp(q, _vector(_F32))
        _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, x_at_v, values, scale_v)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def fma_half_floats(typingctx, acc, acc_at, src, at, x, x_at):
    """acc += f16(src[at + 2i : at + 2i + 2]) · x[x_at+i] (F16 weights, converted by the CPU's f16c)."""
    signature = types.void(acc, acc_at, src, at, x, x_at)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        acc_v, acc_at_v, src_v, at_v, x_v, x_at_v = args
        acc_t, _, src_t, _, x_t = sig.args[:5]
        data = context.make_array(src_t)(context, builder, src_v).data
        pointer = builder.bitcast(builder.gep(data, [at_v]), ir.PointerType(_vector(ir.HalfType())))
        values = builder.fpext(builder.load(pointer, align=1), _vector(_F32))
        _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, x_at_v, values, _ONE)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def fma_brain_floats(typingctx, acc, acc_at, src, at, x, x_at):
    """acc += bf16(src[at + 2i : at + 2i + 2]) · x[x_at+i] (BF16 weights: the top half of a float32)."""
    signature = types.void(acc, acc_at, src, at, x, x_at)

    def codegen(context, builder, sig, args):
        args = _canonical(context, builder, sig, args)
        acc_v, acc_at_v, src_v, at_v, x_v, x_at_v = args
        acc_t, _, src_t, _, x_t = sig.args[:5]
        data = context.make_array(src_t)(context, builder, src_v).data
        pointer = builder.bitcast(builder.gep(data, [at_v]), ir.PointerType(_vector(_I16)))
        bits = builder.shl(builder.zext(builder.load(pointer, align=1), _vector(_I32)), _const(16))
        values = builder.bitcast(bits, _vector(_F32))
        _accumulate(context, builder, acc_t, acc_v, acc_at_v, x_t, x_v, x_at_v, values, _ONE)
        return context.get_dummy_value()

    return signature, codegen


def _shuffle(builder, vector, lanes: list[int]):
    return builder.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _store_floats(context, builder, array_type, array, at, values) -> None:
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [at]), ir.PointerType(values.type))
    builder.store(values, pointer, align=4)


def _k_scales(context, builder, src_type, src, at, d, dmin):
    """A Q4_K/Q5_K super-block's 8 sub-block scales and minimums from its 12 packed 6-bit bytes at
    src[at…], as float vectors (d·scale_j, −(dmin·min_j)), j = 0…7 (ggml's get_scale_min_k4: j < 4 the
    low 6 bits of bytes j and j+4; j ≥ 4 a nibble of byte j+4 and the top 2 bits of bytes j−4 and j).
    Reads 16 bytes from `at` (the block's quants follow its scales)."""
    scale, minimum = _k_scale_ints(context, builder, src_type, src, at)
    floats = ir.VectorType(_F32, 8)

    def times(values, factor):
        factors = _shuffle(builder, builder.insert_element(ir.Constant(floats, ir.Undefined), factor,
                                                           ir.Constant(_I32, 0)), [0] * 8)
        return builder.fmul(factors, builder.uitofp(values, floats))

    return times(scale, d), builder.fneg(times(minimum, dmin))


def _k_scale_ints(context, builder, src_type, src, at):
    """A Q4_K/Q5_K super-block's 8 six-bit sub-block scales and minimums (scale_j, min_j), j = 0…7, as
    two vectors of 8 int32 lanes, from its 12 packed bytes at src[at…] (reads 16 bytes)."""
    raw = builder.zext(builder.load(_lanes(context, builder, src_type, src, at, _I8), align=1), _vector(_I32))
    eight = ir.VectorType(_I32, 8)

    def const8(value: int):
        return ir.Constant(eight, [value] * 8)

    first_four = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    scale_low = _shuffle(builder, raw, [0, 1, 2, 3, 8, 9, 10, 11])
    scale_top = _shuffle(builder, raw, [0, 1, 2, 3, 0, 1, 2, 3])
    minimum_low = _shuffle(builder, raw, [4, 5, 6, 7, 8, 9, 10, 11])
    minimum_top = _shuffle(builder, raw, [4, 5, 6, 7, 4, 5, 6, 7])
    top = builder.shl(builder.lshr(scale_top, const8(6)), const8(4))
    scale = builder.select(first_four, builder.and_(scale_low, const8(63)),
                           builder.or_(builder.and_(scale_low, const8(15)), top))
    top = builder.shl(builder.lshr(minimum_top, const8(6)), const8(4))
    minimum = builder.select(first_four, builder.and_(minimum_low, const8(63)),
                             builder.or_(builder.lshr(minimum_low, const8(4)), top))
    return scale, minimum


def _add_products(context, builder, acc_type, acc, acc_at, b_type, b, b_at, values) -> None:
    """acc[acc_at : acc_at+n] += values · b[b_at : b_at+n] (values: a float vector of n lanes)."""
    lanes = values.type

    def pointer(array_type, array, at):
        data = context.make_array(array_type)(context, builder, array).data
        return builder.bitcast(builder.gep(data, [at]), ir.PointerType(lanes))

    product = builder.fmul(values, builder.load(pointer(b_type, b, b_at), align=4))
    target = pointer(acc_type, acc, acc_at)
    builder.store(builder.fadd(builder.load(target, align=4), product), target, align=4)


def _k_block(fifth_bits: bool):
    """The primitive for one whole Q4_K (or, with `fifth_bits`, Q5_K) super-block of 256 values."""

    def typer(typingctx, acc, src, at, x, x_at, d, dmin, sums32, sums_at):
        signature = types.void(acc, src, at, x, x_at, d, dmin, sums32, sums_at)

        def codegen(context, builder, sig, args):
            acc_v, src_v, at_v, x_v, x_at_v, d_v, dmin_v, sums_v, sums_at_v = _canonical(
                context, builder, sig, args)
            acc_t, src_t, _, x_t = sig.args[:4]
            scales, minimums = _k_scales(context, builder, src_t, src_v, builder.add(at_v, _i64(4)),
                                         d_v, dmin_v)
            # the minimums' share: −dmin·min_j · Σ x over sub-block j, into the offset lanes
            _add_products(context, builder, acc_t, acc_v, _i64(OFFSET_LANES), sig.args[7], sums_v,
                          sums_at_v, minimums)
            quants = 48 if fifth_bits else 16
            for c in range(4):  # 64 values: 32 bytes, low nibbles sub-block 2c, high nibbles 2c+1
                sums = [None, None]  # Σ q·x of sub-blocks 2c and 2c+1 over both halves, in registers
                for half in range(2):
                    byte_at = builder.add(at_v, _i64(quants + 32 * c + 16 * half))
                    q = _bytes(context, builder, src_t, src_v, byte_at)
                    low, high = builder.and_(q, _const(15)), builder.lshr(q, _const(4))
                    if fifth_bits:  # bit 2c / 2c+1 of the high-bit byte i (bytes 16…47 of the block)
                        bits = _bytes(context, builder, src_t, src_v, builder.add(at_v, _i64(16 + 16 * half)))
                        low = builder.or_(low, builder.shl(builder.and_(builder.lshr(bits, _const(2 * c)),
                                                                         _const(1)), _const(4)))
                        high = builder.or_(high, builder.shl(
                            builder.and_(builder.lshr(bits, _const(2 * c + 1)), _const(1)), _const(4)))
                    x_low = builder.add(x_at_v, _i64(64 * c + 16 * half))
                    for k, (values, x_at) in enumerate(((low, x_low), (high, builder.add(x_low, _i64(32))))):
                        x_lanes = builder.load(_lanes(context, builder, x_t, x_v, x_at, _F32), align=4)
                        product = builder.fmul(_floats(builder, values), x_lanes, flags=_CONTRACT)
                        sums[k] = product if sums[k] is None else builder.fadd(sums[k], product,
                                                                               flags=_CONTRACT)
                for k in range(2):  # acc[bank] += (d·scale_j) · Σ q·x, one fused multiply-add
                    scale = builder.extract_element(scales, ir.Constant(_I32, 2 * c + k))
                    pointer = _lanes(context, builder, acc_t, acc_v, _i64(32 * (c & 1) + LANES * k), _F32)
                    scaled = builder.fmul(sums[k], _splat(builder, scale), flags=_CONTRACT)
                    builder.store(builder.fadd(builder.load(pointer, align=4), scaled, flags=_CONTRACT),
                                  pointer, align=4)
            return context.get_dummy_value()

        return signature, codegen

    typer.__name__ = typer.__qualname__ = "fma_q5_k_block" if fifth_bits else "fma_q4_k_block"
    return typer


def _i64(value: int):
    return ir.Constant(_I64, value)


# Lanes of `acc` after the 8 banks where the K-quants add their minimums/offsets times sums of x.
OFFSET_LANES = 128

fma_q4_k_block = intrinsic(_k_block(fifth_bits=False))
fma_q4_k_block.__doc__ = """acc += one Q4_K super-block (144 bytes at src[at…]) times x[x_at : x_at+256]:
the 8 scales and minimums decoded in registers, each sub-block's Σ q·x summed in registers and added to
its bank as (d·scale_j)·Σ q·x in one multiply-add (before: (d·scale_j)·q·x added for every 16 values,
two products and a load and store each; Zen 4 EPYC, one thread, a 8192 × 2048 Q4_K matrix 1359–1409 →
1243–1299 µs, Q5_K 2048 × 2048 415–443 → 388–401, runs alternated), −dmin·min_j·Σx_j (sums32[sums_at + j])
into the offset lanes."""
fma_q5_k_block = intrinsic(_k_block(fifth_bits=True))
fma_q5_k_block.__doc__ = "As fma_q4_k_block for a Q5_K super-block (176 bytes, fifth bits at bytes 16…47)."


def _byte_const(value: int):
    return ir.Constant(_vector(_I8), [value] * LANES)


@intrinsic
def fma_q6_k_block(typingctx, acc, src, at, x, x_at, d):
    """acc += one Q6_K super-block (210 bytes at src[at…]) times x[x_at : x_at+256], its values taken
    before their −32 offset (the caller adds −32·d·scale_k·Σ x over sub-block k): in each half h of 128
    values, byte j of the low nibbles (64·h…) and of the high bits (128 + 32·h…) give values j, j+32,
    j+64, j+96, sub-block k = 8·h + j // 16 + 2·quarter scaled by d·int8(byte 192 + k).
    The bits are cut from each byte once, in byte lanes, and the two halves' products of a bank summed in
    registers before one add into it. Against one primitive per 16 values (bytes widened to 32-bit lanes
    first, loaded again for each quarter, a bank read and written each time), on a Zen 3 EPYC, one
    thread, runs alternated in one process, medians of 5 (µs): a 2048 × 768 expert of Qwen3-30B-A3B 383
    → 335, 20,000 rows of its 2048-column LM head 8460 → 6625 (still 5-6 G values/s to Q4_K's 9-11)."""
    signature = types.void(acc, src, at, x, x_at, d)

    def codegen(context, builder, sig, args):
        acc_v, src_v, at_v, x_v, x_at_v, d_v = _canonical(context, builder, sig, args)
        acc_t, src_t, _, x_t = sig.args[:4]
        raw = _byte_lanes(context, builder, src_t, src_v, builder.add(at_v, _i64(192)))
        scales = builder.fmul(builder.sitofp(raw, _vector(_F32)), _splat(builder, d_v))
        for part in range(2):  # bytes j = 16·part … 16·part + 15 of each half
            totals = [None] * 4  # per quarter: both halves' scale·q·x, in registers
            for h in range(2):
                low = builder.add(at_v, _i64(64 * h + 16 * part))
                l1 = _byte_lanes(context, builder, src_t, src_v, low)
                l2 = _byte_lanes(context, builder, src_t, src_v, builder.add(low, _i64(32)))
                high = builder.add(at_v, _i64(128 + 32 * h + 16 * part))
                bits = _byte_lanes(context, builder, src_t, src_v, high)
                nibbles = (builder.and_(l1, _byte_const(15)), builder.and_(l2, _byte_const(15)),
                           builder.lshr(l1, _byte_const(4)), builder.lshr(l2, _byte_const(4)))
                for quarter in range(4):
                    top = builder.and_(builder.lshr(bits, _byte_const(2 * quarter)), _byte_const(3))
                    q = builder.or_(nibbles[quarter], builder.shl(top, _byte_const(4)))
                    values = builder.uitofp(q, _vector(_F32))
                    x_at = builder.add(x_at_v, _i64(128 * h + 16 * part + 32 * quarter))
                    x_lanes = builder.load(_lanes(context, builder, x_t, x_v, x_at, _F32), align=4)
                    scale = builder.extract_element(scales, ir.Constant(_I32, 8 * h + part + 2 * quarter))
                    product = builder.fmul(builder.fmul(values, x_lanes, flags=_CONTRACT),
                                           _splat(builder, scale), flags=_CONTRACT)
                    totals[quarter] = product if totals[quarter] is None else builder.fadd(
                        totals[quarter], product, flags=_CONTRACT)
            for quarter in range(4):
                pointer = _lanes(context, builder, acc_t, acc_v, _i64(16 * quarter + 64 * part), _F32)
                builder.store(builder.fadd(builder.load(pointer, align=4), totals[quarter], flags=_CONTRACT),
                              pointer, align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def signed_scales(typingctx, src, at, d, out):
    """out[k] = d · int8(src[at + k]) for k = 0…15 (Q6_K's sub-block scales)."""
    signature = types.void(src, at, d, out)

    def codegen(context, builder, sig, args):
        src_v, at_v, d_v, out_v = _canonical(context, builder, sig, args)
        raw = _byte_lanes(context, builder, sig.args[0], src_v, at_v)
        values = builder.fmul(builder.sitofp(raw, _vector(_F32)), _splat(builder, d_v))
        _store_floats(context, builder, sig.args[3], out_v, ir.Constant(_I64, 0), values)
        return context.get_dummy_value()

    return signature, codegen


def _products(lanes: int):
    @intrinsic
    def products(typingctx, acc, acc_at, a, a_at, b, b_at, factor):
        signature = types.void(acc, acc_at, a, a_at, b, b_at, factor)

        def codegen(context, builder, sig, args):
            acc_v, acc_at_v, a_v, a_at_v, b_v, b_at_v, factor_v = _canonical(context, builder, sig, args)
            vector = ir.VectorType(_F32, lanes)

            def pointer(index, array_v, at_v):
                data = context.make_array(sig.args[index])(context, builder, array_v).data
                return builder.bitcast(builder.gep(data, [at_v]), ir.PointerType(vector))

            factor_lanes = _shuffle(builder, builder.insert_element(
                ir.Constant(vector, ir.Undefined), factor_v, ir.Constant(_I32, 0)), [0] * lanes)
            product = builder.fmul(builder.fmul(builder.load(pointer(2, a_v, a_at_v), align=4),
                                                builder.load(pointer(4, b_v, b_at_v), align=4)), factor_lanes)
            target = pointer(0, acc_v, acc_at_v)
            builder.store(builder.fadd(builder.load(target, align=4), product), target, align=4)
            return context.get_dummy_value()

        return signature, codegen

    products.__doc__ = (f"acc[acc_at+i] += factor · a[a_at+i] · b[b_at+i] for i = 0…{lanes - 1} (a block's "
                        "offsets or minimums times its sums of x, added up with the products' lanes)")
    return products


fma_products16 = _products(16)


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask the CPU to bring the cache line holding byte `offset` of `array`'s data into every cache level
    (`llvm.prefetch`, read, locality 3: a hint, which never faults whatever the address)."""
    signature = types.void(array, offset)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        offset = context.cast(builder, args[1], sig.args[1], types.int64)
        pointer = builder.bitcast(builder.gep(data, [offset]), _I8.as_pointer())
        kind = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        function = cgutils.get_or_insert_function(builder.module, kind, "llvm.prefetch.p0i8")
        builder.call(function, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def claim(typingctx, counter):
    """counter[0] += 1, atomically, returning the value before: the next piece of a product shared out
    among threads that each call the kernel (`kernels.matvec`), so no piece is done twice or missed
    whichever thread asks first."""
    signature = types.int64(counter)

    def codegen(context, builder, sig, args):
        pointer = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", pointer, ir.Constant(_I64, 1), "monotonic")

    return signature, codegen


def _tile_block(rows: int, vectors: int):
    """The register block of prefill's tile product (`kernels.tile_product`): `rows` weight rows by
    16·`vectors` tokens over `depth` consecutive columns, rows·vectors accumulators of 16 lanes kept in
    registers. 6 × 4 (24 accumulators, 4 vectors of x and a broadcast weight: 29 of AVX-512's 32
    registers) measured fastest; 3 × 8 spills accumulators and ran at 120 GFLOP/s against 150–190."""

    @intrinsic
    def tile_block(typingctx, partial, partial_at, out, out_at, out_stride, tokens_left, a, a_at, a_stride,
                   b, b_at, b_stride, depth, start, finish):
        signature = types.void(partial, partial_at, out, out_at, out_stride, tokens_left, a, a_at, a_stride,
                               b, b_at, b_stride, depth, start, finish)

        def codegen(context, builder, sig, args):
            (partial_v, partial_at_v, out_v, out_at_v, out_stride_v, left_v, a_v, a_at_v, a_stride_v, b_v,
             b_at_v, b_stride_v, depth_v, start_v, finish_v) = _canonical(context, builder, sig, args)
            partial_data = context.make_array(sig.args[0])(context, builder, partial_v).data
            out_data = context.make_array(sig.args[2])(context, builder, out_v).data
            a_data = context.make_array(sig.args[6])(context, builder, a_v).data
            b_data = context.make_array(sig.args[9])(context, builder, b_v).data
            vector = _vector(_F32)
            width = LANES * vectors
            starting = builder.icmp_signed("!=", start_v, _i64(0))
            zero = ir.Constant(vector, [0.0] * LANES)

            def partial_lanes(r, v):  # partial[partial_at + r·width + 16·v …]: this block's sums so far
                at = builder.add(partial_at_v, _i64(r * width + LANES * v))
                return builder.bitcast(builder.gep(partial_data, [at]), vector.as_pointer())

            accumulators = [[cgutils.alloca_once(builder, vector) for _ in range(vectors)]
                            for _ in range(rows)]
            for r in range(rows):
                for v in range(vectors):
                    # the first columns start from zero (the load, of scratch, is then discarded)
                    earlier = builder.load(partial_lanes(r, v), align=4)
                    builder.store(builder.select(starting, zero, earlier), accumulators[r][v])
            a_rows = [builder.add(a_at_v, builder.mul(_i64(r), a_stride_v)) for r in range(rows)]
            with cgutils.for_range(builder, depth_v) as loop:
                k = loop.index
                b_row = builder.add(b_at_v, builder.mul(k, b_stride_v))
                xs = [builder.load(builder.bitcast(builder.gep(b_data, [builder.add(b_row, _i64(LANES * v))]),
                                                   vector.as_pointer()), align=4) for v in range(vectors)]
                for r in range(rows):
                    weight = _splat(builder, builder.load(builder.gep(a_data, [builder.add(a_rows[r], k)])))
                    for v in range(vectors):
                        total = builder.load(accumulators[r][v])
                        product = builder.fmul(weight, xs[v], flags=["fast"])
                        builder.store(builder.fadd(total, product, flags=["fast"]), accumulators[r][v])
            totals = [[builder.load(accumulators[r][v]) for v in range(vectors)] for r in range(rows)]
            finishing = builder.icmp_signed("!=", finish_v, _i64(0))
            with builder.if_else(finishing) as (last, more):
                with last:  # out[out_at + token · out_stride + row], tokens past the end skipped
                    for v in range(vectors):
                        for lane in range(LANES):
                            token = LANES * v + lane
                            inside = builder.icmp_signed("<", _i64(token), left_v)
                            with builder.if_then(inside, likely=True):
                                at = builder.add(out_at_v, builder.mul(_i64(token), out_stride_v))
                                for r in range(rows):
                                    value = builder.extract_element(totals[r][v], _i64(lane))
                                    builder.store(value, builder.gep(out_data, [builder.add(at, _i64(r))]))
                with more:
                    for r in range(rows):
                        for v in range(vectors):
                            builder.store(totals[r][v], partial_lanes(r, v), align=4)
            return context.get_dummy_value()

        return signature, codegen

    tile_block.__doc__ = (f"Σ_k a[a_at + r·a_stride + k] · b[b_at + k·b_stride + t] for r < {rows}, "
                          f"t < {LANES * vectors}, k < depth, added to the sums so far in partial[partial_at "
                          "+ r·width + t] (unless `start`); kept there, or with `finish` written to "
                          "out[out_at + t·out_stride + r] for t < tokens_left.")
    return tile_block


def _dot_block(rows: int, tokens: int, lanes: int = LANES):
    """The register block of the few-rows product (`kernels.matmul_rows`): `rows` decoded weight rows
    against `tokens` rows of x over the same columns, rows·tokens accumulators of `lanes` lanes (16 with
    AVX-512, 8 without: `DOT_LANES`) kept in registers, each weight and x vector loaded once, 16 columns
    a step. Written here because numba's loops come out
    in 256-bit vectors (LLVM prefers them on these CPUs): 2 × 4 with 512-bit lanes ran at 2-3× their
    multiply-adds a second (`kernels.matmul_rows`)."""

    @intrinsic
    def dot_block(typingctx, sums, a0, a1, b, b_at, b_stride, steps):
        signature = types.void(sums, a0, a1, b, b_at, b_stride, steps)

        def codegen(context, builder, sig, args):
            sums_v, a0_v, a1_v, b_v, b_at_v, b_stride_v, steps_v = _canonical(context, builder, sig, args)
            sums_data = context.make_array(sig.args[0])(context, builder, sums_v).data
            a_data = [context.make_array(sig.args[1 + r])(context, builder, value).data
                      for r, value in enumerate((a0_v, a1_v)[:rows])]
            b_data = context.make_array(sig.args[3])(context, builder, b_v).data
            vector = ir.VectorType(_F32, lanes)
            accumulators = [[cgutils.alloca_once(builder, vector) for _ in range(tokens)]
                            for _ in range(rows)]
            for row in accumulators:
                for accumulator in row:
                    builder.store(ir.Constant(vector, [0.0] * lanes), accumulator)
            b_rows = [builder.add(b_at_v, builder.mul(_i64(t), b_stride_v)) for t in range(tokens)]

            def load(data, at):
                return builder.load(builder.bitcast(builder.gep(data, [at]), vector.as_pointer()), align=4)

            with cgutils.for_range(builder, steps_v) as loop:
                for half in range(LANES // lanes):  # 16 columns a step, `lanes` at a time
                    column = builder.add(builder.mul(loop.index, _i64(LANES)), _i64(half * lanes))
                    weights = [load(data, column) for data in a_data]
                    xs = [load(b_data, builder.add(at, column)) for at in b_rows]
                    for r in range(rows):
                        for t in range(tokens):
                            total = builder.load(accumulators[r][t])
                            product = builder.fmul(weights[r], xs[t], flags=["fast"])
                            builder.store(builder.fadd(total, product, flags=["fast"]), accumulators[r][t])
            for r in range(rows):
                for t in range(tokens):
                    total = builder.load(accumulators[r][t])
                    width = lanes
                    while width > 1:  # halves added pairwise: 16 → 8 → 4 → 2 → 1 lanes
                        width //= 2
                        low = _shuffle(builder, total, list(range(width)))
                        high = _shuffle(builder, total, list(range(width, 2 * width)))
                        total = builder.fadd(low, high, flags=["fast"])
                    value = builder.extract_element(total, ir.Constant(_I32, 0))
                    builder.store(value, builder.gep(sums_data, [_i64(r * tokens + t)]))
            return context.get_dummy_value()

        return signature, codegen

    dot_block.__doc__ = (f"sums[r·{tokens} + t] = Σ_k a_r[k] · b[b_at + t·b_stride + k] for r < {rows} "
                         f"(a0{', a1' if rows == 2 else ''}), t < {tokens}, k < 16·steps (b a flat float32 "
                         "array).")
    return dot_block


# dot_block_<rows>x<tokens>: two weight rows against four rows of x, and the smaller blocks for a part's
# odd last row and the last 1-3 rows of x.
dot_block_2x4, dot_block_2x3, dot_block_2x2, dot_block_2x1 = (
    _dot_block(2, t, DOT_LANES) for t in (4, 3, 2, 1))
dot_block_1x4, dot_block_1x3, dot_block_1x2, dot_block_1x1 = (
    _dot_block(1, t, DOT_LANES) for t in (4, 3, 2, 1))


# tile_block_<rows>x<vectors>: 6 rows a block, and 4 for the end of a tile whose rows are not a
# multiple of 6; 4 vectors (64 tokens) a block, and 1 to 3 for the last tokens.
tile_block_6x4, tile_block_6x3, tile_block_6x2, tile_block_6x1 = (_tile_block(6, v) for v in (4, 3, 2, 1))
tile_block_4x4, tile_block_4x3, tile_block_4x2, tile_block_4x1 = (_tile_block(4, v) for v in (4, 3, 2, 1))


# ------------------------------------------------------------------------------ 8-bit activations
#
# llama.cpp's numerics (`ember.quant.q8`): x quantized to signed bytes per 256 values (Q8_K), a K-quant
# super-block's integer values multiplied by them in integer lanes (AVX2's pmaddubsw: 32 byte products
# summed in pairs to 16-bit lanes; pmaddwd: 16-bit lanes times the sub-block scales, summed in pairs to
# 32-bit lanes), one float multiply per super-block. 32 multiply-adds an instruction where the float
# path does 8.

_BYTES32 = ir.VectorType(_I8, 32)
_SHORTS16 = ir.VectorType(_I16, 16)
_INTS8 = ir.VectorType(_I32, 8)
_FLOATS8 = ir.VectorType(_F32, 8)


def has_avx2() -> bool:
    """Whether this CPU has AVX2 (the 8-bit products' byte and 16-bit multiply-adds) and F16C (their
    f16 scales, `_half`; every AVX2 CPU has it)."""
    return has_cpu_flag("avx2") and has_cpu_flag("f16c")


def _vector_at(context, builder, array_type, array, at, vector: ir.VectorType):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.load(builder.bitcast(builder.gep(data, [at]), ir.PointerType(vector)), align=1)


def _x86(builder, name: str, result: ir.Type, *operands):
    kind = ir.FunctionType(result, [operand.type for operand in operands])
    return builder.call(cgutils.get_or_insert_function(builder.module, kind, name), list(operands))


def _byte_products(builder, unsigned, signed, scales):
    """Σ over pairs of unsigned·signed bytes (32 each) times a 16-bit scale per pair, summed in pairs:
    8 int32 lanes. Products stay exact: |q·y| ≤ 63·127, a pair's sum below 2^15."""
    pairs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _SHORTS16, unsigned, signed)
    return _x86(builder, "llvm.x86.avx2.pmadd.wd", _INTS8, pairs, scales)


def _short_lanes(builder, ints, lanes: list[int]):
    """16 int16 lanes taken from lanes of an int32 vector (truncated)."""
    return _shuffle(builder, builder.trunc(ints, ir.VectorType(_I16, len(ints.type))), lanes)


def _add_floats(context, builder, acc_type, acc, acc_at, values) -> None:
    data = context.make_array(acc_type)(context, builder, acc).data
    pointer = builder.bitcast(builder.gep(data, [acc_at]), ir.PointerType(values.type))
    builder.store(builder.fadd(builder.load(pointer, align=4), values), pointer, align=4)


def _times(builder, ints, factor):
    factors = _shuffle(builder, builder.insert_element(ir.Constant(_FLOATS8, ir.Undefined), factor,
                                                       ir.Constant(_I32, 0)), [0] * 8)
    return builder.fmul(builder.sitofp(ints, _FLOATS8), factors)


def _row_scale(context, builder, xs_type, xs, xs_at, xs_stride, t: int):
    """xs[xs_at + t·xs_stride]: the block scale of row t of the rounded activations."""
    data = context.make_array(xs_type)(context, builder, xs).data
    return builder.load(builder.gep(data, [builder.add(xs_at, builder.mul(xs_stride, _i64(t)))]))


def _q4_k_q8(tokens: int):
    """The Q4_K super-block primitive for `tokens` (1-4 or 8) rounded activation rows at once: the
    block's scales, minimums and nibbles taken from its bytes once, then multiplied by each row's bytes,
    32 values at a time for all rows (the rows' sums in registers, the weights' 32 values loaded once:
    in the other order, all 8 sub-blocks' values kept for row after row, the registers spilled.
    Zen 3, one thread, 8 rows times 768 x 2048 in cache: 341 us that way, 296 this way, 265 with 8
    rows at a time where 4 and 4 were two calls)."""

    def typer(typingctx, acc, src, at, q8, q8_at, stride, sums32, sums_at, sums_stride, xs, xs_at, xs_stride):
        signature = types.void(acc, src, at, q8, q8_at, stride, sums32, sums_at, sums_stride, xs, xs_at,
                               xs_stride)

        def codegen(context, builder, sig, args):
            (acc_v, src_v, at_v, q8_v, q8_at_v, stride_v, sums_v, sums_at_v, sums_stride_v, xs_v, xs_at_v,
             xs_stride_v) = _canonical(context, builder, sig, args)
            acc_t, src_t, _, q8_t, _, _, sums_t, _, _, xs_t = sig.args[:10]
            d_v = _half(context, builder, src_t, src_v, at_v)
            dmin_v = _half(context, builder, src_t, src_v, builder.add(at_v, _i64(2)))
            scales, minimums = _k_scale_ints(context, builder, src_t, src_v, builder.add(at_v, _i64(4)))
            nibbles = []
            for c in range(4):  # 64 values: 32 bytes, low nibbles sub-block 2c, high nibbles 2c+1
                q = _vector_at(context, builder, src_t, src_v, builder.add(at_v, _i64(16 + 32 * c)), _BYTES32)
                nibbles += [builder.and_(q, ir.Constant(_BYTES32, [15] * 32)),
                            builder.lshr(q, ir.Constant(_BYTES32, [4] * 32))]
            rows = [builder.add(q8_at_v, builder.mul(stride_v, _i64(t))) for t in range(tokens)]
            totals = [None] * tokens
            for j in range(8):  # sub-block outermost: its nibbles and scale, then every row's bytes
                factor = _short_lanes(builder, scales, [j] * 16)
                for t in range(tokens):
                    y = _vector_at(context, builder, q8_t, q8_v, builder.add(rows[t], _i64(32 * j)), _BYTES32)
                    part = _byte_products(builder, nibbles[j], y, factor)
                    totals[t] = part if totals[t] is None else builder.add(totals[t], part)
            for t in range(tokens):
                scale_x = _row_scale(context, builder, xs_t, xs_v, xs_at_v, xs_stride_v, t)
                sums = _vector_at(context, builder, sums_t, sums_v,
                                  builder.add(sums_at_v, builder.mul(sums_stride_v, _i64(t))), _INTS8)
                _add_floats(context, builder, acc_t, acc_v, _i64(16 * t + 8), builder.fneg(
                    _times(builder, builder.mul(minimums, sums), builder.fmul(dmin_v, scale_x))))
                _add_floats(context, builder, acc_t, acc_v, _i64(16 * t),
                            _times(builder, totals[t], builder.fmul(d_v, scale_x)))
            return context.get_dummy_value()

        return signature, codegen

    typer.__name__ = typer.__qualname__ = f"q4_k_q8_block_{tokens}"
    typer.__doc__ = f"""acc[16t : 16t+8] += d·xs[xs_at + t·xs_stride] · Σ_j scale_j Σ q·y_t and
acc[16t+8 : 16t+16] −= dmin·xs[…] · Σ_j min_j · sums32[sums_at + t·sums_stride + j] for t < {tokens}:
one Q4_K super-block (144 bytes at src[at…]) times 256 signed bytes y_t = q8[q8_at + t·stride …] of
each row (xs the rows' block scales, sums32 their sums over 32 values): ggml's ggml_vec_dot_q4_K_q8_K,
row by row."""
    return intrinsic(typer)


def _q6_k_q8(tokens: int):
    """The Q6_K super-block primitive for `tokens` (1-4 or 8) rounded activation rows at once, in the
    Q4_K one's order (8 rows times 2048 x 768 in cache: 402 us before, 314 after)."""

    def typer(typingctx, acc, src, at, q8, q8_at, stride, sums16, sums_at, sums_stride, xs, xs_at, xs_stride):
        signature = types.void(acc, src, at, q8, q8_at, stride, sums16, sums_at, sums_stride, xs, xs_at,
                               xs_stride)

        def codegen(context, builder, sig, args):
            (acc_v, src_v, at_v, q8_v, q8_at_v, stride_v, sums_v, sums_at_v, sums_stride_v, xs_v, xs_at_v,
             xs_stride_v) = _canonical(context, builder, sig, args)
            acc_t, src_t, _, q8_t, _, _, sums_t, _, _, xs_t = sig.args[:10]
            d_v = _half(context, builder, src_t, src_v, builder.add(at_v, _i64(208)))
            raw = builder.sext(_byte_lanes(context, builder, src_t, src_v, builder.add(at_v, _i64(192))),
                               _vector(_I32))

            def byte_const(value):
                return ir.Constant(_BYTES32, [value] * 32)

            def block_bytes(offset):
                return _vector_at(context, builder, src_t, src_v, builder.add(at_v, _i64(offset)), _BYTES32)

            totals = []
            for t in range(tokens):
                sums = builder.load(_lanes(context, builder, sums_t, sums_v,
                                           builder.add(sums_at_v, builder.mul(sums_stride_v, _i64(t))), _I32),
                                    align=4)
                offsets = builder.mul(raw, sums)  # −32 · Σ_k scale_k · (sum of y over sub-block k)
                offsets = builder.add(_shuffle(builder, offsets, list(range(8))),
                                      _shuffle(builder, offsets, list(range(8, 16))))
                totals.append(builder.sub(ir.Constant(_INTS8, [0] * 8),
                                          builder.shl(offsets, ir.Constant(_INTS8, [5] * 8))))
            rows = [builder.add(q8_at_v, builder.mul(stride_v, _i64(t))) for t in range(tokens)]
            for h in range(2):  # 32 values at a time, outermost: their 6-bit values and scales, every row
                low, low2, bits = block_bytes(64 * h), block_bytes(64 * h + 32), block_bytes(128 + 32 * h)
                nibbles = (builder.and_(low, byte_const(15)), builder.and_(low2, byte_const(15)),
                           builder.lshr(low, byte_const(4)), builder.lshr(low2, byte_const(4)))
                for quarter in range(4):  # y offset 128h + 32·quarter
                    top = builder.and_(builder.lshr(bits, byte_const(2 * quarter)), byte_const(3))
                    values = builder.or_(nibbles[quarter], builder.shl(top, byte_const(4)))
                    first = 8 * h + 2 * quarter
                    factor = _short_lanes(builder, raw, [first] * 8 + [first + 1] * 8)
                    for t in range(tokens):
                        y = _vector_at(context, builder, q8_t, q8_v,
                                       builder.add(rows[t], _i64(128 * h + 32 * quarter)), _BYTES32)
                        totals[t] = builder.add(totals[t], _byte_products(builder, values, y, factor))
            for t in range(tokens):
                scale_x = _row_scale(context, builder, xs_t, xs_v, xs_at_v, xs_stride_v, t)
                _add_floats(context, builder, acc_t, acc_v, _i64(16 * t),
                            _times(builder, totals[t], builder.fmul(d_v, scale_x)))
            return context.get_dummy_value()

        return signature, codegen

    typer.__name__ = typer.__qualname__ = f"q6_k_q8_block_{tokens}"
    typer.__doc__ = f"""acc[16t : 16t+8] += d·xs[xs_at + t·xs_stride] · Σ_k scale_k Σ (q − 32)·y_t for
t < {tokens}: one Q6_K super-block (210 bytes at src[at…]) times 256 signed bytes
y_t = q8[q8_at + t·stride …] of each row, the −32 taken as −32·Σ_k scale_k·sums16[sums_at +
t·sums_stride + k] (sums over 16 values): ggml's ggml_vec_dot_q6_K_q8_K. Value j, j+32, j+64, j+96 of
half h: the low and high nibble of bytes 64h + j and 64h + 32 + j, and 2-bit pairs of byte 128 + 32h + j."""
    return intrinsic(typer)


def _half(context, builder, src_type, src, at):
    """The f16 at bytes src[at], src[at + 1] as float32, converted by the CPU (F16C's vcvtph2ps: exact,
    the value `kernels.F16_TABLE` holds): how the 8-bit products read their blocks' scales. The table's
    256 KB competed with the streamed weights for L2: one Q4_K row of 2816 columns times 1408 rows (Zen 3,
    one thread, weights out of cache, medians of 37) took 255-265 µs with the table, 219-234 with F16C
    (in cache 185-190 / 196)."""
    data = context.make_array(src_type)(context, builder, src).data
    bits = builder.load(builder.bitcast(builder.gep(data, [at]), ir.PointerType(_I16)), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)


@intrinsic
def round_to_half(typingctx, value):
    """A float32 rounded to the nearest f16 (ties to even, as NumPy's float16 conversion), as float32:
    F16C's vcvtps2ph and back."""
    signature = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), _F32)

    return signature, codegen


def _signed_products(builder, w, y):
    """Σ over pairs of w·y for 32 signed bytes w and y, in 8 int32 lanes, as ggml forms them on AVX2
    (|w| times y with w's sign; exact: |w·y| ≤ 128·127)."""
    magnitude = _x86(builder, "llvm.x86.avx2.psign.b", _BYTES32, w, w)
    signed = _x86(builder, "llvm.x86.avx2.psign.b", _BYTES32, y, w)
    return _byte_products(builder, magnitude, signed, ir.Constant(_SHORTS16, [1] * 16))


def _q5_0_values(context, builder, src_t, src_v, at_v):
    """A Q5_0 block's 32 values w_j = (nibble_j | bit_j << 4) − 16 as signed bytes (nibbles 0-15 the low
    halves of bytes 6-21, 16-31 the high halves; bits from the u32 at byte 2), formed as ggml does: the
    nibble OR'd with 0xF0 where the high bit is clear."""
    data = context.make_array(src_t)(context, builder, src_v).data
    high = builder.load(builder.bitcast(builder.gep(data, [builder.add(at_v, _i64(2))]),
                                        ir.PointerType(_I32)), align=1)
    bits = builder.bitcast(builder.xor(high, ir.Constant(_I32, -1)), ir.VectorType(ir.IntType(1), 32))
    clear = builder.sext(bits, _BYTES32)  # 0xFF where the bit is clear
    packed = _byte_lanes(context, builder, src_t, src_v, builder.add(at_v, _i64(6)))
    nibbles = builder.shuffle_vector(builder.and_(packed, ir.Constant(packed.type, [15] * 16)),
                                     builder.lshr(packed, ir.Constant(packed.type, [4] * 16)),
                                     ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return builder.or_(nibbles, builder.and_(clear, ir.Constant(_BYTES32, [0xF0] * 32)))


def _q8_0_q8(five: bool, tokens: int):
    """The Q8_0 (or Q5_0) block primitive for `tokens` (1-4 or 8) rounded activation rows: the block's
    32 values formed once, then multiplied by each row's 32 bytes."""

    def typer(typingctx, acc, src, at, q8, q8_at, stride, xs, xs_at, xs_stride):
        signature = types.void(acc, src, at, q8, q8_at, stride, xs, xs_at, xs_stride)

        def codegen(context, builder, sig, args):
            acc_v, src_v, at_v, q8_v, q8_at_v, stride_v, xs_v, xs_at_v, xs_stride_v = _canonical(
                context, builder, sig, args)
            acc_t, src_t, _, q8_t, _, _, xs_t = sig.args[:7]
            d_v = _half(context, builder, src_t, src_v, at_v)
            if five:
                w = _q5_0_values(context, builder, src_t, src_v, at_v)
            else:
                w = _vector_at(context, builder, src_t, src_v, builder.add(at_v, _i64(2)), _BYTES32)
            for t in range(tokens):
                y_at = builder.add(q8_at_v, builder.mul(stride_v, _i64(t)))
                y = _vector_at(context, builder, q8_t, q8_v, y_at, _BYTES32)
                scale_x = _row_scale(context, builder, xs_t, xs_v, xs_at_v, xs_stride_v, t)
                _add_floats(context, builder, acc_t, acc_v, _i64(32 * t),
                            _times(builder, _signed_products(builder, w, y), builder.fmul(d_v, scale_x)))
            return context.get_dummy_value()

        return signature, codegen

    name = "q5_0" if five else "q8_0"
    typer.__name__ = typer.__qualname__ = f"{name}_q8_block_{tokens}"
    content = "32 high bits and 16 bytes of nibbles" if five else "32 signed bytes"
    typer.__doc__ = f"""acc[32t : 32t+8] += d·xs[xs_at + t·xs_stride] · Σ w·y_t in 8 lanes for t < {tokens}:
one {name.upper()} block at src[at…] (an f16 scale d, then {content}) times 32
signed bytes y_t = q8[q8_at + t·stride …] of each row: ggml_vec_dot_{name}_q8_0's block, row by row."""
    return intrinsic(typer)


q8_0_q8_block_1, q8_0_q8_block_2, q8_0_q8_block_3, q8_0_q8_block_4, q8_0_q8_block_8 = (
    _q8_0_q8(False, n) for n in (1, 2, 3, 4, 8))
q5_0_q8_block_1, q5_0_q8_block_2, q5_0_q8_block_3, q5_0_q8_block_4, q5_0_q8_block_8 = (
    _q8_0_q8(True, n) for n in (1, 2, 3, 4, 8))


q4_k_q8_block_1, q4_k_q8_block_2, q4_k_q8_block_3, q4_k_q8_block_4, q4_k_q8_block_8 = (
    _q4_k_q8(n) for n in (1, 2, 3, 4, 8))
q6_k_q8_block_1, q6_k_q8_block_2, q6_k_q8_block_3, q6_k_q8_block_4, q6_k_q8_block_8 = (
    _q6_k_q8(n) for n in (1, 2, 3, 4, 8))


@intrinsic
def sum_lanes16(typingctx, acc, at):
    """acc[at] + … + acc[at + 15] as a tree of vector adds (8 + 8, 4 + 4, 2 + 2, 1 + 1): a row's total
    in 4 dependent adds where a scalar loop takes 15."""
    signature = types.float32(acc, at)

    def codegen(context, builder, sig, args):
        acc_v, at_v = _canonical(context, builder, sig, args)
        values = builder.load(_lanes(context, builder, sig.args[0], acc_v, at_v, _F32), align=4)
        width = LANES
        while width > 1:
            width //= 2
            values = builder.fadd(_shuffle(builder, values, list(range(width))),
                                  _shuffle(builder, values, list(range(width, 2 * width))))
        return builder.extract_element(values, ir.Constant(_I32, 0))

    return signature, codegen


@intrinsic
def read_counter(typingctx, counter):
    """counter[0], read atomically (an atomic add of 0): a load LLVM cannot hoist out of a waiting loop."""
    signature = types.int64(counter)

    def codegen(context, builder, sig, args):
        pointer = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", pointer, ir.Constant(_I64, 0), "monotonic")

    return signature, codegen


@intrinsic
def pause(typingctx):
    """The CPU's spin-wait hint (x86 `pause`: lets the other hardware thread run, saves power)."""
    signature = types.void()

    def codegen(context, builder, sig, args):
        kind = ir.FunctionType(ir.VoidType(), [])
        builder.call(cgutils.get_or_insert_function(builder.module, kind, "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return signature, codegen


def _element_pointer(context, builder, sig, args):
    """A pointer to args[0][args[1]] (a one-dimensional int64 array, an integer index)."""
    data = context.make_array(sig.args[0])(context, builder, args[0]).data
    return builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])


@intrinsic
def exchange_if(typingctx, states, index, expected, new):
    """states[index] = new if it holds `expected`, atomically; return the value it held before (equal to
    `expected`: this thread set it). Acquire and release: what the thread wrote before is seen by one that
    reads the new value (`kernels.publish`)."""
    signature = types.int64(states, index, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig, args)
        pair = builder.cmpxchg(pointer, args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return signature, codegen


@intrinsic
def load_state(typingctx, states, index):
    """states[index], read with acquire ordering: once it shows a value another thread stored with
    `store_state`, what that thread wrote before the store is seen too."""
    signature = types.int64(states, index)

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_element_pointer(context, builder, sig, args), "acquire", 8)

    return signature, codegen


@intrinsic
def store_state(typingctx, states, index, value):
    """states[index] = value with release ordering (see `load_state`)."""
    signature = types.void(states, index, types.int64)

    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _element_pointer(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()

    return signature, codegen
