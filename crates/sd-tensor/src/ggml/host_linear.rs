//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): a linear
//! layer `y = W x + b` over many columns, as f32 matrix products on the `gemm` crate.
//!
//! **Why.** ggml's CPU product of an f16 weight rounds the activations to f16 first and
//! converts both operands back to f32 in its inner loop (tinyBLAS, 185-190 GFLOP/s on this
//! project's 2-core AVX-512 machine); `gemm`'s f32 product, with its AVX-512 kernels, runs
//! 195-200 GFLOP/s on the same shapes and keeps the activations in f32.
//!
//! **The op.** Sources: `src[0]` the input `[K, N1, N2, N3]` f32 (contiguous), `src[1]` the
//! weight `[K, M]` f16 or f32 (contiguous), `src[2]` the bias `[M]` f32 or absent; `dst`
//! `[M, N1, N2, N3]` f32. The output features (rows of the weight) go in chunks of at most
//! [`CHUNK_VALUES`] values (and at least three a thread) to whichever thread asks first
//! (`claim_chunks`: threads on faster cores take more); each converts its chunk to f32,
//! starts those rows of the output at the bias (when there is one) and accumulates one
//! product of the chunk with all `N = N1 N2 N3` columns. The weight is read once a call;
//! its conversion costs `1 / (2 N)` of the work per value, so the op is used from
//! [`MIN_COLUMNS`] columns.
//!
//! Sums run in another order than ggml's and in f32 throughout: results agree with ggml's
//! f32 product to f32 rounding.
//!
//! **The convolution after an im2col** ([`conv_kernel`]): the convolutions of f16 kernels the
//! implicit kernel does not take (strided, or over images narrower than its minimum: the
//! SD UNets' 32x32, 16x16 and 8x8 levels and their downsamplers) are this same product of
//! the kernel `[KW KH C, OC]` with this crate's f32 im2col `[KW KH C, OW OH N]`, each image's
//! block written straight into the `[OW, OH, OC, N]` layout with the bias (ggml's path
//! rounds the im2col to f16 and runs its f16 product: 217 against 297-352 GFLOP/s for these
//! shapes on the 2-core AMX Xeon of 2026-12-06, then a layout pass). Threads split the
//! output channels and, when there are few row tiles for the threads, the columns.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

use super::host_conv::{claim_chunks, thread_share, with_scratch, F32Source};
use crate::dtype::DType;

/// Columns (`N1 N2 N3`) below which a linear layer keeps ggml's product.
pub(crate) const MIN_COLUMNS: usize = 512;

/// f32 values of a thread's converted weight chunk at most (8 MiB). Every chunk packs the
/// whole input again: at 1 MiB a `2560 -> 640` layer over 2048 columns ran at 174 GFLOP/s,
/// at 8 MiB 195 (ggml's product: 182).
const CHUNK_VALUES: usize = 2 * 1024 * 1024;

/// f32 im2col values (4 bytes each) above which a convolution keeps ggml's f16 im2col
/// (half the bytes): 256 MiB, beyond the SD UNets' and far below a large VAE encode's
/// (1.2 GB at 1024x1024).
const MAX_IM2COL_VALUES: usize = 64 * 1024 * 1024;

/// Whether [`conv_kernel`] computes a convolution of a kernel of `kernel_type` (contiguous)
/// with `k = KW KH C` values per output value, `oc` output channels and `columns = OW OH N`
/// output pixels: f16 kernels of at least 16 output channels whose f32 im2col stays within
/// [`MAX_IM2COL_VALUES`].
pub(crate) fn covers_conv(
    kernel_type: Option<DType>,
    kernel_contiguous: bool,
    k: usize,
    oc: usize,
    columns: usize,
) -> bool {
    kernel_type == Some(DType::F16)
        && kernel_contiguous
        && oc >= 16
        && k.checked_mul(columns)
            .is_some_and(|v| v <= MAX_IM2COL_VALUES)
}

/// Whether the kernel computes `weight x`: weight `[K, M]` (2-D) f16 or f32, contiguous;
/// `x` `[K, ...]` f32 contiguous with at least [`MIN_COLUMNS`] columns.
pub(crate) fn covers(
    weight_ne: [usize; 4],
    weight_type: Option<DType>,
    weight_contiguous: bool,
    x_ne: [usize; 4],
    x_f32_contiguous: bool,
) -> bool {
    let columns = x_ne[1] * x_ne[2] * x_ne[3];
    let (typed, min_columns) = match weight_type {
        Some(DType::F16 | DType::F32) => (true, MIN_COLUMNS),
        // On AMX tiles: with the weight as the tiles' rows (512+ features) nothing is packed
        // per call but 32 tokens at a time, so a block of 32 tokens is enough.
        #[cfg(target_arch = "x86_64")]
        Some(DType::BF16 | DType::Q8_0) => (
            super::host_amx::covers(weight_ne[0], weight_ne[1], weight_contiguous),
            if weight_ne[1] >= super::host_amx::TOKEN_ROWS_BELOW {
                super::host_amx::BLOCK
            } else {
                MIN_COLUMNS
            },
        ),
        _ => (false, MIN_COLUMNS),
    };
    typed
        && weight_contiguous
        && weight_ne[2] == 1
        && weight_ne[3] == 1
        && weight_ne[0] == x_ne[0]
        && x_f32_contiguous
        && columns >= min_columns
}

/// Thread `ith` of `nth`'s output features (weight rows) of `m`, in multiples of 16 (the
/// products' row tiles).
fn feature_rows(m: usize, ith: usize, nth: usize) -> std::ops::Range<usize> {
    let tiles = thread_share(m.div_ceil(16), ith as c_int, nth as c_int);
    (tiles.start * 16).min(m)..(tiles.end * 16).min(m)
}

/// The output features (weight rows) of `m` a thread converts and multiplies at a time, of
/// an `m x k` weight computed by `nth` threads: a multiple of 16 (the products' row tiles)
/// of at most [`CHUNK_VALUES`] values, and at least three chunks a thread where the layer
/// is large enough, so that handing them out by demand evens out the threads' speeds.
fn feature_chunk(m: usize, k: usize, nth: usize) -> usize {
    let by_size = (CHUNK_VALUES / k.max(1)).max(16);
    let by_threads = m.div_ceil(3 * nth.max(1)).max(16);
    by_size.min(by_threads).div_ceil(16) * 16
}

/// `dst (+)= lhs x`: `lhs` the weight's rows as f32 (`[h, k]` row-major, `h = lhs.len() / k`),
/// `x` `cols` columns of `k` contiguous values each, `dst` `[h, cols]` with rows contiguous
/// and columns `dst_cs` values apart; added to what `dst` holds when `accumulate`.
///
/// # Safety
/// `x` holds `cols * k` values; `dst` holds the `[h, cols]` block at those strides, written by
/// this thread alone.
unsafe fn rows_times_columns(
    lhs: &[f32],
    k: usize,
    x: *const f32,
    cols: usize,
    dst: *mut f32,
    dst_cs: usize,
    accumulate: bool,
) {
    // SAFETY: see the function's contract.
    unsafe {
        gemm::gemm(
            lhs.len() / k,
            cols,
            k,
            dst,
            dst_cs as isize,
            1,
            accumulate,
            lhs.as_ptr(),
            1,
            k as isize,
            x,
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The custom op (see the module doc): each of the `nth` threads computes the chunks of
/// the output it claims (`claim_chunks`); ggml's thread index is not needed.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::linear_host` after [`covers`]
/// accepted its sources (the bias checked there too).
pub(crate) unsafe extern "C" fn linear_kernel(
    dst: *mut sys::ggml_tensor,
    _ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract: src[0] the input, src[1] the weight, src[2] the
    // bias or null.
    let (d, x, w, bias) = unsafe {
        (
            &*dst,
            &*(*dst).src[0],
            &*(*dst).src[1],
            (*dst).src[2].as_ref(),
        )
    };
    let (k, m) = (w.ne[0] as usize, w.ne[1] as usize);
    let n = (x.ne[1] * x.ne[2] * x.ne[3]) as usize;
    // SAFETY: the bias holds M f32 values when present.
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.data as *const f32, m) });
    #[cfg(target_arch = "x86_64")]
    if w.type_ == sys::GGML_TYPE_BF16 || w.type_ == sys::GGML_TYPE_Q8_0 {
        // SAFETY: `covers` took a bf16 or q8_0 weight only where the tile products cover it.
        unsafe { super::host_amx::linear(d, x, w, bias, nth as usize) };
        return;
    }
    let chunk = feature_chunk(m, k, nth as usize);
    let out = d.data as *mut f32;
    // SAFETY: the weight holds K*M f16 or f32 values, contiguous (`covers`).
    let weight = unsafe { F32Source::of(w, k * m) };
    with_scratch(chunk * k, |buf| {
        // Chunks of output features to whichever thread is free (see `claim_chunks`).
        claim_chunks(dst as usize, nth, m, chunk, |rows| {
            let (r0, r1) = (rows.start, rows.end);
            let lhs = weight.f32_values(r0 * k..r1 * k, buf);
            // Output rows r0..r1 of every column start at the bias.
            if let Some(b) = bias {
                for col in 0..n {
                    // SAFETY: dst is `[M, N]` f32 contiguous; rows r0..r1 of a column
                    // belong to this thread alone.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(out.add(col * m + r0), r1 - r0) };
                    dst.copy_from_slice(&b[r0..r1]);
                }
            }
            // SAFETY: x is [K, N] (column j at j K); the output block [r1 - r0, N] starts at
            // row r0, columns M apart; rows r0..r1 are this thread's.
            unsafe {
                rows_times_columns(
                    lhs,
                    k,
                    x.data as *const f32,
                    n,
                    out.add(r0),
                    m,
                    bias.is_some(),
                )
            };
        });
    });
}

/// Output pixels a product of [`conv_kernel`] computes at a time into its scratch (the
/// block is then written transposed into the output planes, with the bias).
const CONV_COLUMN_BLOCK: usize = 512;

/// The convolution op (see the module doc): `dst` `[OW, OH, OC, N]` f32 from `src[0]`, the
/// f32 im2col `[K, OW, OH, N]` (contiguous), `src[1]`, the kernel `[KW, KH, C, OC]` f16 or f32
/// (contiguous, `K = KW KH C`), and `src[2]`, the bias `[OC]` f32 or null. With at least as
/// many tiles of 16 output channels as threads, chunks of channels go to whichever thread
/// asks first (`claim_chunks`), each for all pixels; else the threads form a grid of row
/// groups by column groups (output pixels of all images, in order). A thread converts its
/// rows of the kernel to f32 and, for blocks of [`CONV_COLUMN_BLOCK`] pixels of one image,
/// runs the product as the linear layer does (channels innermost, into its scratch), then
/// writes the block into the image's planes.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::conv_2d_host` after [`covers_conv`]
/// accepted its kernel (shapes, types and the bias checked there).
pub(crate) unsafe extern "C" fn conv_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract: src[0] the im2col, src[1] the kernel, src[2] the
    // bias or null.
    let (d, im, w, bias) = unsafe {
        (
            &*dst,
            &*(*dst).src[0],
            &*(*dst).src[1],
            (*dst).src[2].as_ref(),
        )
    };
    let k = im.ne[0] as usize;
    let plane = (d.ne[0] * d.ne[1]) as usize;
    let (m, images) = (d.ne[2] as usize, d.ne[3] as usize);
    // SAFETY: the bias holds M f32 values when present.
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.data as *const f32, m) });
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    let out = d.data as *mut f32;
    let x = im.data as *const f32;
    // SAFETY: the kernel holds K*M f16 or f32 values, contiguous (`covers_conv`).
    let weight = unsafe { F32Source::of(w, k * m) };
    // Output channels r0..r1 for the columns (pixels of all images, in order) `cols`, with
    // this thread's scratch: the kernel's rows as f32, and a block of the product.
    let run = |rows: std::ops::Range<usize>,
               cols: std::ops::Range<usize>,
               buf: &mut [f32],
               block: &mut [f32]| {
        let (r0, r1) = (rows.start, rows.end);
        let h = r1 - r0;
        let lhs = weight.f32_values(r0 * k..r1 * k, buf);
        // Blocks of one image's pixels.
        let mut c0 = cols.start;
        while c0 < cols.end {
            let img = c0 / plane;
            let c1 = cols.end.min((img + 1) * plane).min(c0 + CONV_COLUMN_BLOCK);
            let wide = c1 - c0;
            // SAFETY: the im2col's column c (all images in order) is K values at c K; the
            // block is [h, wide], column j at j h, this thread's scratch.
            unsafe {
                rows_times_columns(lhs, k, x.add(c0 * k), wide, block.as_mut_ptr(), h, false)
            };
            // Plane `oc` of image `img` starts at (img M + oc) * plane; this block is its
            // pixels p0..p0 + wide.
            let p0 = c0 - img * plane;
            for oc in r0..r1 {
                let b = bias.map_or(0.0, |b| b[oc]);
                // SAFETY: oc < M and p0 + wide <= plane: inside dst; rows r0..r1 of these
                // pixels belong to this thread alone.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out.add((img * m + oc) * plane + p0), wide)
                };
                for (j, v) in dst.iter_mut().enumerate() {
                    *v = block[j * h + (oc - r0)] + b;
                }
            }
            c0 = c1;
        }
    };
    let tiles = m.div_ceil(16);
    if tiles == 0 {
        return;
    }
    if tiles >= nth {
        // Chunks of output channels, all pixels each, to whichever thread is free (see
        // `claim_chunks`).
        let chunk = feature_chunk(m, k, nth);
        with_scratch(chunk * k + chunk * CONV_COLUMN_BLOCK, |scratch| {
            let (buf, block) = scratch.split_at_mut(chunk * k);
            claim_chunks(dst as usize, nth as c_int, m, chunk, |rows| {
                run(rows, 0..plane * images, buf, block)
            });
        });
        return;
    }
    // Fewer channel tiles than threads: a grid of row groups by column groups.
    let row_groups = tiles;
    let col_groups = nth / row_groups;
    if ith >= row_groups * col_groups {
        return;
    }
    let (rg, cg) = (ith % row_groups, ith / row_groups);
    let rows = feature_rows(m, rg, row_groups);
    let cols = thread_share(plane * images, cg as c_int, col_groups as c_int);
    if rows.is_empty() || cols.is_empty() {
        return;
    }
    let chunk = (CHUNK_VALUES / k.max(1)).max(16).min(rows.len());
    with_scratch(chunk * k + chunk * CONV_COLUMN_BLOCK, |scratch| {
        let (buf, block) = scratch.split_at_mut(chunk * k);
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + chunk).min(rows.end);
            run(r0..r1, cols.clone(), buf, block);
            r0 = r1;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    fn amx() -> bool {
        crate::ggml::host_amx::available()
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn amx() -> bool {
        false
    }

    #[test]
    fn only_wide_inputs_of_f16_or_f32_weights_take_the_kernel() {
        let (f16, f32, bf16) = (Some(DType::F16), Some(DType::F32), Some(DType::BF16));
        // (weight ne, type, weight contiguous, x ne, x f32 contiguous, covered)
        let cases = [
            ([320, 1280, 1, 1], f16, true, [320, 4096, 2, 1], true, true),
            ([320, 1280, 1, 1], f32, true, [320, 512, 1, 1], true, true),
            ([320, 1280, 1, 1], f16, true, [320, 77, 2, 1], true, false),
            // bf16 weights: on AMX tiles where the CPU has them (`host_amx.rs`).
            (
                [320, 1280, 1, 1],
                bf16,
                true,
                [320, 4096, 2, 1],
                true,
                cfg!(target_arch = "x86_64") && amx(),
            ),
            (
                [320, 1280, 1, 1],
                f16,
                true,
                [320, 4096, 2, 1],
                false,
                false,
            ),
            ([320, 1280, 2, 1], f16, true, [320, 4096, 2, 1], true, false),
            (
                [320, 1280, 1, 1],
                f16,
                false,
                [320, 4096, 2, 1],
                true,
                false,
            ),
        ];
        for (i, (w, t, wc, x, xc, covered)) in cases.into_iter().enumerate() {
            assert_eq!(covers(w, t, wc, x, xc), covered, "case {i}");
        }
    }
}
