//! The bf16 products of [`super::host_attention`]: `S = scale Q K^T` and `O = P V` on
//! AVX512-BF16 dot products (`vdpbf16ps`: two bf16 products per f32 lane and instruction,
//! twice the f32 FMA rate), for graphs whose weights are bf16 (`sd --type bf16`), where the
//! f32 products were a fifth of an SD1.5 UNet step.
//!
//! Q, K, V and the softmax numerators `P` are rounded to bf16 (to nearest even, as ggml
//! rounds), the sums stay f32: the precision PyTorch's bf16 attention has. Lanes run over
//! queries, so the score block keeps the column-major layout of the f32 path (its softmax is
//! shared) and each output column is one vector a query block.
//!
//! Operands are packed as 32-bit words holding a pair of bf16 values along the products'
//! inner dimension: K row `j` as its `d / 2` pairs (its values in order), Q as `[d / 2][mp]`
//! (pair `p` of every query, `mp` the block's queries rounded up to 16), `P` as
//! `[n_kv / 2][mp]` (keys `2r` and `2r + 1` of every query) and V as `[n_kv / 2][dv]`
//! (keys `2r` and `2r + 1` of every column). An odd key count gets a zero key.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

/// Queries a kernel tile covers, in vectors of 16.
const QV: usize = 4;
/// Keys (scores) or output columns (values) a kernel tile covers.
const CN: usize = 6;

/// Whether this CPU runs the kernels (AVX-512 F and BF16).
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// One f32 as bf16 bits, rounded to nearest even (NaN kept quiet), as ggml rounds.
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    half::bf16::from_f32(x).to_bits() as u32
}

/// A pair of bf16 values in one word (`lo` first in memory).
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) | bf16_bits(hi) << 16
}

/// `n` f32 values at `src` times `scale` as bf16 bits at `dst`, rounded to nearest even
/// (`vcvtneps2bf16`, 16 a step, the tail masked; NaN stays a quiet NaN, as
/// [`bf16_bits`] rounds, but denormal inputs become zero).
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and BF16 ([`available`]); `n` values are readable at
/// `src` and writable at `dst`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn bf16_scaled_row(src: *const f32, n: usize, scale: f32, dst: *mut u16) {
    let s = _mm512_set1_ps(scale);
    let mut i = 0;
    while i < n {
        let k = (n - i).min(16);
        let mask: __mmask16 = if k == 16 { 0xffff } else { (1u16 << k) - 1 };
        let x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src.add(i)), s);
        let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(x));
        _mm256_mask_storeu_epi16(dst.add(i) as *mut i16, mask, h);
        i += 16;
    }
}

/// Packs `rows` rows of `width` f32 values (row `i` at `src.add(i * stride)`, `width` even)
/// as their `width / 2` pairs each: `dst[i * width / 2 + p]`.
///
/// # Safety
/// The rows lie inside their tensor; `dst` holds `rows * width / 2` words.
pub(crate) unsafe fn pack_rows(
    src: *const f32,
    stride: usize,
    rows: usize,
    width: usize,
    dst: &mut [u32],
) {
    let half = width / 2;
    for i in 0..rows {
        let row = std::slice::from_raw_parts(src.add(i * stride), width);
        for (p, w) in dst[i * half..(i + 1) * half].iter_mut().enumerate() {
            *w = pair(row[2 * p], row[2 * p + 1]);
        }
    }
}

/// Packs `m` query rows (row `i` at `src.add(i * stride)`, `width` values, even) as
/// `[width / 2][mp]` pairs, queries `m..mp` zero.
///
/// # Safety
/// As [`pack_rows`]; `dst` holds `width / 2 * mp` words.
pub(crate) unsafe fn pack_queries(
    src: *const f32,
    stride: usize,
    m: usize,
    mp: usize,
    width: usize,
    dst: &mut [u32],
) {
    dst[..width / 2 * mp].fill(0);
    for i in 0..m {
        let row = std::slice::from_raw_parts(src.add(i * stride), width);
        for p in 0..width / 2 {
            dst[p * mp + i] = pair(row[2 * p], row[2 * p + 1]);
        }
    }
}

/// Packs the `n` rows of V (row `j` at `src.add(j * stride)`, `dv` values) as
/// `[n.div_ceil(2)][dv]` pairs of consecutive keys (a missing last key is zero).
///
/// # Safety
/// As [`pack_rows`]; `dst` holds `n.div_ceil(2) * dv` words.
pub(crate) unsafe fn pack_values(
    src: *const f32,
    stride: usize,
    n: usize,
    dv: usize,
    dst: &mut [u32],
) {
    for r in 0..n.div_ceil(2) {
        let a = std::slice::from_raw_parts(src.add(2 * r * stride), dv);
        let out = &mut dst[r * dv..(r + 1) * dv];
        if 2 * r + 1 < n {
            let b = std::slice::from_raw_parts(src.add((2 * r + 1) * stride), dv);
            for c in 0..dv {
                out[c] = pair(a[c], b[c]);
            }
        } else {
            for c in 0..dv {
                out[c] = bf16_bits(a[c]);
            }
        }
    }
}

/// Packs the column-major scores `s` (`[mp, n]`, column `j` at `j * mp`) as
/// `[n.div_ceil(2)][mp]` pairs of consecutive keys (a missing last key is zero).
///
/// # Safety
/// The CPU has AVX-512 F and BF16 ([`available`]); `mp` is a multiple of 16, `s` holds
/// `mp * n` values and `dst` `n.div_ceil(2) * mp` words.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn pack_scores(s: &[f32], mp: usize, n: usize, dst: &mut [u32]) {
    let zero = _mm512_setzero_ps();
    for r in 0..n.div_ceil(2) {
        let a = s.as_ptr().add(2 * r * mp);
        let b = (2 * r + 1 < n).then(|| s.as_ptr().add((2 * r + 1) * mp));
        let out = dst.as_mut_ptr().add(r * mp);
        for i in (0..mp).step_by(16) {
            let lo = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(
                a.add(i),
            )));
            let hi = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(match b {
                Some(b) => _mm512_loadu_ps(b.add(i)),
                None => zero,
            }));
            let w = _mm512_or_si512(
                _mm512_cvtepu16_epi32(lo),
                _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
            );
            _mm512_storeu_si512(out.add(i) as *mut _, w);
        }
    }
}

/// Calls `$f::<Q, C>($args)` for the runtime tile sizes `$q` (1..=4) and `$c` (1..=6), so
/// that each tile's accumulators are a fixed set of registers.
macro_rules! dispatch {
    ($f:ident, $q:expr, $c:expr, $($args:expr),*) => {
        match ($q, $c) {
            (4, 6) => $f::<4, 6>($($args),*),
            (4, 5) => $f::<4, 5>($($args),*),
            (4, 4) => $f::<4, 4>($($args),*),
            (4, 3) => $f::<4, 3>($($args),*),
            (4, 2) => $f::<4, 2>($($args),*),
            (4, 1) => $f::<4, 1>($($args),*),
            (3, 6) => $f::<3, 6>($($args),*),
            (3, 5) => $f::<3, 5>($($args),*),
            (3, 4) => $f::<3, 4>($($args),*),
            (3, 3) => $f::<3, 3>($($args),*),
            (3, 2) => $f::<3, 2>($($args),*),
            (3, 1) => $f::<3, 1>($($args),*),
            (2, 6) => $f::<2, 6>($($args),*),
            (2, 5) => $f::<2, 5>($($args),*),
            (2, 4) => $f::<2, 4>($($args),*),
            (2, 3) => $f::<2, 3>($($args),*),
            (2, 2) => $f::<2, 2>($($args),*),
            (2, 1) => $f::<2, 1>($($args),*),
            (1, 6) => $f::<1, 6>($($args),*),
            (1, 5) => $f::<1, 5>($($args),*),
            (1, 4) => $f::<1, 4>($($args),*),
            (1, 3) => $f::<1, 3>($($args),*),
            (1, 2) => $f::<1, 2>($($args),*),
            _ => $f::<1, 1>($($args),*),
        }
    };
}

/// The accumulators of a tile of `Q` query vectors by `C` broadcast words: for each of the
/// `n` steps `t`, `acc[c][v] += a(t, v) . b(t, c)` in bf16 pairs, with `a(t, v)` the 16
/// words at `a[t * a_stride + 16 v]` and `b(t, c)` the word `b[c * b_col + t * b_step]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile<const Q: usize, const C: usize>(
    a: *const u32,
    a_stride: usize,
    b: *const u32,
    b_col: usize,
    b_step: usize,
    n: usize,
) -> [[__m512; Q]; C] {
    let mut acc = [[_mm512_setzero_ps(); Q]; C];
    for t in 0..n {
        let mut av = [_mm512_setzero_ps(); Q];
        for (v, x) in av.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(a.add(t * a_stride + 16 * v) as *const f32);
        }
        for (c, row) in acc.iter_mut().enumerate() {
            let w = *b.add(c * b_col + t * b_step) as i32;
            let bv = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w));
            for (x, a) in row.iter_mut().zip(av.iter()) {
                *x = _mm512_dpbf16_ps(*x, std::mem::transmute::<__m512, __m512bh>(*a), bv);
            }
        }
    }
    acc
}

/// One score tile: queries `q0..q0 + 16 Q`, keys `j0..j0 + C`, stored scaled.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn score_tile<const Q: usize, const C: usize>(
    qp: &[u32],
    kp: &[u32],
    half: usize,
    mp: usize,
    q0: usize,
    j0: usize,
    scale: f32,
    s: &mut [f32],
) {
    let acc = tile::<Q, C>(
        qp.as_ptr().add(q0),
        mp,
        kp.as_ptr().add(j0 * half),
        half,
        1,
        half,
    );
    let sc = _mm512_set1_ps(scale);
    for (c, row) in acc.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            _mm512_storeu_ps(
                s.as_mut_ptr().add((j0 + c) * mp + q0 + 16 * v),
                _mm512_mul_ps(*x, sc),
            );
        }
    }
}

/// `S = scale Q K^T` into the column-major `s` (`[mp, n_kv]`, column `j` at `j * mp`), from
/// `qp` (`[half][mp]`, see [`pack_queries`]) and `kp` (`[n_kv][half]`, see [`pack_rows`]).
///
/// # Safety
/// As [`pack_scores`]; `qp` holds `half * mp` words, `kp` `n_kv * half`, `s` `mp * n_kv`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn scores(
    qp: &[u32],
    kp: &[u32],
    half: usize,
    mp: usize,
    n_kv: usize,
    scale: f32,
    s: &mut [f32],
) {
    for q0 in (0..mp).step_by(16 * QV) {
        let qv = ((mp - q0) / 16).min(QV);
        let mut j0 = 0;
        while j0 < n_kv {
            let cn = (n_kv - j0).min(CN);
            dispatch!(score_tile, qv, cn, qp, kp, half, mp, q0, j0, scale, s);
            j0 += cn;
        }
    }
}

/// One output tile: queries `q0..q0 + 16 Q`, columns `c0..c0 + C`, scaled per query.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn value_tile<const Q: usize, const C: usize>(
    pp: &[u32],
    vp: &[u32],
    pairs: usize,
    mp: usize,
    dv: usize,
    m: usize,
    inv: &[f32],
    o: *mut f32,
    stride: usize,
    q0: usize,
    c0: usize,
) {
    let acc = tile::<Q, C>(pp.as_ptr().add(q0), mp, vp.as_ptr().add(c0), 1, dv, pairs);
    let mut lanes = [0f32; 16];
    for (c, row) in acc.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            _mm512_storeu_ps(lanes.as_mut_ptr(), *x);
            for (l, val) in lanes.iter().enumerate() {
                let i = q0 + 16 * v + l;
                if i < m {
                    *o.add(i * stride + c0 + c) = val * inv[i];
                }
            }
        }
    }
}

/// `O = P V` for the `m` queries of a block: row `i` of the output at `o.add(i * stride)`
/// gets `dv` values, each scaled by `inv[i]`; from `pp` (`[pairs][mp]`, see
/// [`pack_scores`]) and `vp` (`[pairs][dv]`, see [`pack_values`]).
///
/// # Safety
/// As [`pack_scores`]; `pp` holds `pairs * mp` words, `vp` `pairs * dv`, the output rows lie
/// inside their tensor, `inv` holds `m` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn values(
    pp: &[u32],
    vp: &[u32],
    pairs: usize,
    mp: usize,
    dv: usize,
    m: usize,
    inv: &[f32],
    o: *mut f32,
    stride: usize,
) {
    for q0 in (0..mp).step_by(16 * QV) {
        let qv = ((mp - q0) / 16).min(QV);
        let mut c0 = 0;
        while c0 < dv {
            let cn = (dv - c0).min(CN);
            dispatch!(value_tile, qv, cn, pp, vp, pairs, mp, dv, m, inv, o, stride, q0, c0);
            c0 += cn;
        }
    }
}
