//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): the gated
//! GELU of a feed-forward layer (GEGLU: `value * gelu(gate)`, the value the first half of
//! each row of the projection, the gate the second), in one pass.
//!
//! **Why.** With ggml's ops a GEGLU is two `cont` copies of the row halves (views of the
//! projection are not contiguous), a GELU and a multiplication: nine passes over tensors of
//! `[1280, 8192]` f32 at an SD1.5 UNet's 64x64 level, 5-6% of a bf16 step on the AMX tiles
//! (`perf`, 2026-12-07). This kernel reads each row once and writes the product.
//!
//! **The GELU** is PyTorch's default (exact) form, `x (1 + erf(x / sqrt 2)) / 2`, as the
//! reference implementations compute it, with `erf` by Abramowitz and Stegun's 7.1.26
//! (absolute error below 1.5e-7) and its `exp` by this crate's vectorisable
//! `exp_nonpositive` (a few ulp): within 1e-6 of ggml's `gelu_erf` over the values a
//! network meets (test in `tests/ggml_roundtrip.rs`). ggml's `gelu` (the tanh
//! approximation, on a table of f16 inputs) is what the graph runs without this kernel and
//! without exact numerics; this kernel is closer to the reference either way.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

use super::host_conv::{f32_row, thread_share};

/// `x (1 + erf(x / sqrt 2)) / 2` (see the module doc), branch-free so that a loop of it
/// vectorises.
#[inline(always)]
pub(crate) fn gelu_erf(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_8,
        -1.453_152,
        1.061_405_4,
    ];
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + P * z);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let erf_abs = 1.0 - poly * super::host_attention::exp_nonpositive(-z * z);
    let erf = if x < 0.0 { -erf_abs } else { erf_abs };
    0.5 * x * (1.0 + erf)
}

/// `out[i] = value[i] * gelu_erf(gate[i])` over one row.
#[inline(always)]
fn geglu_row(value: &[f32], gate: &[f32], out: &mut [f32]) {
    for ((o, v), g) in out.iter_mut().zip(value).zip(gate) {
        *o = v * gelu_erf(*g);
    }
}

/// [`geglu_row`] compiled for AVX-512 (the README's build is baseline x86-64: the portable
/// loop runs 128-bit vectors there).
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn geglu_row_avx512(value: &[f32], gate: &[f32], out: &mut [f32]) {
    geglu_row(value, gate, out)
}

/// The custom op: `dst` `[I, N1, N2, N3]` f32 (contiguous) from `src[0]` `[2 I, N1, N2, N3]`
/// f32 with contiguous rows (row strides `nb[1..]`): each row's first `I` values times the
/// GELU of its last `I`. Thread `ith` of `nth` takes a share of the rows.
///
/// # Safety
/// Called by ggml on a `dst` built by `Context::geglu`, which checked the shapes and types.
pub(crate) unsafe extern "C" fn geglu_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract.
    let (d, p) = unsafe { (&*dst, &*(*dst).src[0]) };
    let inner = d.ne[0] as usize;
    let rows = (d.ne[1] * d.ne[2] * d.ne[3]) as usize;
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx512f");
    for r in thread_share(rows, ith, nth) {
        // SAFETY: row r of the source (2 I values at its strides; its dims 1-3 are dst's)
        // and of dst (I values, contiguous) lie inside them; this thread alone writes row r
        // of dst.
        let (src, out) = unsafe {
            (
                f32_row(p, r, 2 * inner),
                std::slice::from_raw_parts_mut((d.data as *mut f32).add(r * inner), inner),
            )
        };
        let (value, gate) = src.split_at(inner);
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: the CPU has AVX-512 F.
            unsafe { geglu_row_avx512(value, gate, out) };
            continue;
        }
        geglu_row(value, gate, out);
    }
}
