//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): GELU's tanh
//! form (PyTorch's `gelu(approximate="tanh")`, transformers' `gelu_new`), optionally times
//! a second tensor (T5's gated feed-forward), in one pass.
//!
//! **Why.** Exact numerics on the CPU built this GELU from nine ggml ops (`x^3`, scales,
//! adds, a `tanh`, products): nine passes over the largest activations of a DiT block (the
//! MLP's `[4 h, tokens]`) with a barrier each, and ggml's `tanh` is glibc's scalar `tanhf`
//! (`__expm1f` and `__tanhf` were 6.3% of a FLUX step on the CPU, `perf`, 2026-12-07).
//! ggml's own `gelu` is one pass but reads a table of f16 inputs (not exact).
//!
//! **The formula.** With `y = sqrt(2/pi) (x + 0.044715 x^3)` and `e = exp(-2 |y|)`,
//! `1 + tanh(y)` is `2 / (1 + e)` for `y >= 0` and `2 e / (1 + e)` for `y < 0`, so
//! `gelu(x) = x * (y < 0 ? e : 1) / (1 + e)`: no cancellation in either tail, `e` from this
//! crate's vectorisable `exp_nonpositive` (a few ulp). Against the formula in f64: 1.3e-6
//! relative for `|x| <= 4`, 1.2e-5 in the negative tail (the f32 rounding of `y`, which any
//! f32 computation has, times `2|y|`), 5e-7 absolute (test below); the nine f32 ops it
//! replaces cancel in that tail (`1 + tanh(y)` keeps a few bits at `x = -4.5` and is 0 from
//! about `x = -5.6`).
//! Against those ops: within 1e-6 of the values' scale (`tests/ggml_roundtrip.rs`).

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

use super::host_attention::exp_nonpositive;
use super::host_conv::{f32_row, thread_share};

/// `sqrt(2 / pi)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// GELU, tanh form (see the module doc), branch-free so that a loop of it vectorises.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    let y = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let e = exp_nonpositive(-2.0 * y.abs());
    let num = if y < 0.0 { e } else { 1.0 };
    x * num / (1.0 + e)
}

/// `out[i] = gelu_tanh(x[i])`, times `gate[i]` where given.
#[inline(always)]
fn gelu_tanh_row(x: &[f32], times: Option<&[f32]>, out: &mut [f32]) {
    match times {
        Some(t) => {
            for ((o, v), m) in out.iter_mut().zip(x).zip(t) {
                *o = gelu_tanh(*v) * m;
            }
        }
        None => {
            for (o, v) in out.iter_mut().zip(x) {
                *o = gelu_tanh(*v);
            }
        }
    }
}

/// [`gelu_tanh_row`] compiled for AVX-512 (the README's build is baseline x86-64: the
/// portable loop runs 128-bit vectors there).
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_tanh_row_avx512(x: &[f32], times: Option<&[f32]>, out: &mut [f32]) {
    gelu_tanh_row(x, times, out)
}

/// The custom op: `dst` f32 (contiguous) from `src[0]` of the same shape, f32 with
/// contiguous rows (any row strides), and optionally `src[1]` likewise: each value's GELU,
/// times `src[1]`'s where it is given. Thread `ith` of `nth` takes a share of the rows.
///
/// # Safety
/// Called by ggml on a `dst` built by `Context::gelu_tanh_host`, which checked the shapes
/// and types.
pub(crate) unsafe extern "C" fn gelu_tanh_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract.
    let d = unsafe { &*dst };
    let (x, times) = unsafe { (&*d.src[0], d.src[1].as_ref()) };
    let n = d.ne[0] as usize;
    let rows = (d.ne[1] * d.ne[2] * d.ne[3]) as usize;
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx512f");
    for r in thread_share(rows, ith, nth) {
        // SAFETY: row r of the sources lies inside them (shapes checked equal); this
        // thread alone writes row r of dst, which is contiguous.
        let (xr, tr, out) = unsafe {
            (
                f32_row(x, r, n),
                times.map(|t| f32_row(t, r, n)),
                std::slice::from_raw_parts_mut((d.data as *mut f32).add(r * n), n),
            )
        };
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: the CPU has AVX-512 F.
            unsafe { gelu_tanh_row_avx512(xr, tr, out) };
            continue;
        }
        gelu_tanh_row(xr, tr, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formula in f64, with `1 + tanh(y)` as `2 / (1 + e^(-2y))` (no cancellation in
    /// the negative tail, where `1 + tanh(y)` in f64 is 0 from `x = -8` on).
    fn reference(x: f32) -> f64 {
        let x = x as f64;
        let y = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
        x / (1.0 + (-2.0 * y).exp())
    }

    #[test]
    fn gelu_tanh_is_within_a_few_ulp_of_the_formula() {
        // Relative error per region: |x| <= 4 (where a network's activations mostly are;
        // 2e-6 there is 16 ulp at x = -4, where `2|y|` is 10), and the negative tail, where the value is `x e^(-2|y|)` and the f32 rounding of
        // `y` (as any f32 computation of `y` has it) is amplified by `2|y|`.
        let (mut core, mut tail, mut worst_abs) = (0f64, 0f64, 0f64);
        let mut x = -12.0f32;
        while x <= 12.0 {
            let (got, want) = (gelu_tanh(x) as f64, reference(x));
            let abs = (got - want).abs();
            worst_abs = worst_abs.max(abs);
            // (Below 1e-35 the value leaves f32's normal range: `e` is flushed to 0 there.)
            if want.abs() > 1e-35 {
                let rel = abs / want.abs();
                if x.abs() <= 4.0 {
                    core = core.max(rel);
                } else {
                    tail = tail.max(rel);
                }
            }
            x += 0.000_731;
        }
        println!("relative: |x| <= 4 {core:e}, tails {tail:e}; absolute {worst_abs:e}");
        assert!(core < 2e-6, "relative {core:e} for |x| <= 4");
        assert!(tail < 5e-5, "relative {tail:e} in the tails");
        assert!(worst_abs < 1e-6, "absolute {worst_abs:e}");
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!(gelu_tanh(f32::NAN).is_nan());
        assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
    }
}
