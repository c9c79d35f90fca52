//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): the stride-1
//! 2-D convolution of ggml-layout activations (`[W, H, C, N]`, channels outside the rows)
//! as matrix products over shifted views of the zero-padded input, with no im2col matrix.
//!
//! **Why.** The im2col path writes `KH KW` copies of the input (at 512x512 with 128
//! channels, the SD VAE decoder's last stage: a 600 MB f16 matrix per convolution) and rounds
//! the activations to f16 for ggml's f16 product, which converts them back to f32 in its
//! inner loop (159 GFLOP/s on the SD1.5 UNet on this project's 2-core AVX-512 machine,
//! against 185-200 GFLOP/s for the `gemm` crate's f32 product on the same shapes).
//!
//! **How.** Pad each channel plane to `PW = W + 2 px` columns. In the padded grid, output
//! pixel `q = y PW + x` reads, for kernel tap `(ky, kx)`, input value `q + ky PW + kx` of
//! every channel plane: so the whole convolution is `KH KW` products
//! `out[OC, q] += K_tap[OC, C] in[C, q + ky PW + kx]`, each over a view of the same padded
//! planes shifted by the tap's offset (rows one plane apart, columns contiguous). The
//! `KW - 1` columns of each padded row that are not output pixels cost `(KW - 1) / PW` of
//! extra work and are dropped on the way out.
//!
//! **The op.** Sources: `src[0]` the input `[W, H, C, N]` f32 with contiguous rows, `src[1]`
//! the kernel `[KW, KH, C, OC]` f16 or f32 (contiguous), `src[2]` the bias `[OC]` f32 or
//! absent; `dst` `[OW, OH, OC, N]` f32. Work items are (output-channel chunk, image, block of
//! output rows), chunks outermost; each thread takes a contiguous run of items, converts
//! its chunk of the kernel to f32 in tap-major order (`[tap][oc][c]`) once per chunk it
//! meets, copies the block's padded input rows (all channels) into its scratch, runs the
//! `KH KW` products into an output block (`gemm`, accumulating), and writes the block's
//! rows with the bias added. Blocks are sized so that the input rows stay near 2 MiB; a
//! kernel chunk holds at most 8 MiB of f32.
//!
//! **When.** Stride 1 and dilation 1 only, f16 or f32 kernels (bf16 kernels keep the bf16
//! im2col, whose dot products run at twice this rate where the CPU has AVX512-BF16), and at
//! least [`MIN_PIXELS`] output pixels an image: below that, a product's share of packing
//! the kernel slice grows and the f16 im2col path is as fast. Sums run in another order and
//! in f32 throughout (the activations are not rounded to f16): results agree with ggml's f32
//! convolution to f32 rounding, not bit for bit.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

use crate::dtype::DType;

use super::host_conv::{thread_share, with_scratch, F32Source, Im2colGeometry};

/// Output pixels an image (in the padded grid: `OH * PW`) below which a convolution keeps
/// the im2col path.
pub(crate) const MIN_PIXELS: usize = 256;

/// Padded columns per column of the padded grid that is not an output pixel, at least:
/// the `KW - 1` extra columns of each row must stay within 1/32 of the work (a 3x3 kernel
/// takes images at least 62 wide). At 32 wide the 6% waste made a 3x3 convolution of 640
/// channels slower than the f16 im2col path on AVX-512 (172 against 178 GFLOP/s, 2 threads).
const MAX_WASTE: usize = 32;

/// f32 values of one block's padded input rows (2 MiB).
const BLOCK_INPUT_VALUES: usize = 512 * 1024;

/// f32 values of a thread's converted kernel chunk at most (8 MiB).
const KERNEL_CHUNK_VALUES: usize = 2 * 1024 * 1024;

/// Whether the implicit kernel computes this convolution: kernel `[KW, KH, C, OC]` of
/// `kernel_type` (contiguous), input `[W, H, C, N]` f32 with contiguous rows, stride and
/// dilation 1, enough output pixels an image.
pub(crate) fn covers(
    kernel_ne: [usize; 4],
    kernel_type: Option<DType>,
    kernel_contiguous: bool,
    input_ne: [usize; 4],
    geometry: Im2colGeometry,
) -> bool {
    let unit = geometry.stride == [1, 1] && geometry.dilation == [1, 1];
    let typed = matches!(kernel_type, Some(DType::F16 | DType::F32));
    let Some((_, oh)) = geometry.output_size(input_ne[0], input_ne[1]) else {
        return false;
    };
    let padded_width = input_ne[0] + 2 * geometry.pad[0] as usize;
    // The padded grid's columns that are not output pixels are wasted work.
    let waste_ok = (kernel_ne[0] - 1) * MAX_WASTE <= padded_width;
    unit && typed
        && kernel_contiguous
        && kernel_ne[2] == input_ne[2]
        && waste_ok
        && oh * padded_width >= MIN_PIXELS
}

/// One convolution's sizes and its split into work items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    /// Input width, height, channels, images.
    w: usize,
    h: usize,
    c: usize,
    n: usize,
    /// Kernel width and height, paddings (x, y).
    kw: usize,
    kh: usize,
    px: usize,
    py: usize,
    /// Padded input width; output width, height and channels.
    pw: usize,
    ow: usize,
    oh: usize,
    oc: usize,
    /// Output rows a block (the last block of an image may have fewer); blocks an image.
    rows: usize,
    blocks: usize,
    /// Output channels a chunk (the last may have fewer); chunks.
    chunk: usize,
    chunks: usize,
}

impl Plan {
    /// The plan for `nth` threads.
    fn new(input: [usize; 4], oc: usize, g: Im2colGeometry, nth: usize) -> Plan {
        let [w, h, c, n] = input;
        let (kw, kh) = (g.kernel[0] as usize, g.kernel[1] as usize);
        let (px, py) = (g.pad[0] as usize, g.pad[1] as usize);
        let pw = w + 2 * px;
        let (ow, oh) = (pw + 1 - kw, h + 2 * py + 1 - kh);
        // Rows a block: its padded input rows near BLOCK_INPUT_VALUES, then evened out.
        let fit = (BLOCK_INPUT_VALUES / (pw * c).max(1)).saturating_sub(kh - 1);
        let blocks = oh.div_ceil(fit.clamp(1, oh));
        let rows = oh.div_ceil(blocks);
        // Output channels a chunk: within KERNEL_CHUNK_VALUES, and enough chunks that every
        // thread has an item when the images have few blocks.
        let by_memory = (KERNEL_CHUNK_VALUES / (c * kw * kh).max(1)).max(16);
        let for_threads = nth.div_ceil(n * blocks).min(oc.div_ceil(16)).max(1);
        let chunks = oc.div_ceil(by_memory).max(for_threads);
        let chunk = oc.div_ceil(chunks);
        let chunks = oc.div_ceil(chunk);
        Plan {
            w,
            h,
            c,
            n,
            kw,
            kh,
            px,
            py,
            pw,
            ow,
            oh,
            oc,
            rows,
            blocks,
            chunk,
            chunks,
        }
    }

    /// Work items: chunks x images x blocks.
    fn items(&self) -> usize {
        self.chunks * self.n * self.blocks
    }

    /// Item `i` as (chunk, image, block).
    fn item(&self, i: usize) -> (usize, usize, usize) {
        let per_chunk = self.n * self.blocks;
        let (chunk, rest) = (i / per_chunk, i % per_chunk);
        (chunk, rest / self.blocks, rest % self.blocks)
    }

    /// f32 scratch values a thread needs: the kernel chunk, a block's input rows, a block's
    /// output.
    fn scratch(&self) -> [usize; 3] {
        [
            self.chunk * self.c * self.kw * self.kh,
            (self.rows + self.kh - 1) * self.pw * self.c,
            self.chunk * self.rows * self.pw,
        ]
    }
}

/// The custom op (see the module doc): thread `ith` of `nth` computes its run of items.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::conv_2d_host` after [`covers`]
/// accepted its sources (types, shapes and strides checked there), `userdata` the packed
/// [`Im2colGeometry`].
pub(crate) unsafe extern "C" fn implicit_conv_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let geometry = Im2colGeometry::unpack(userdata as usize);
    // SAFETY: see the function's contract: src[0] the input, src[1] the kernel, src[2] the
    // bias or null.
    let (d, x, k, bias) = unsafe {
        (
            &*dst,
            &*(*dst).src[0],
            &*(*dst).src[1],
            (*dst).src[2].as_ref(),
        )
    };
    let input = [0, 1, 2, 3].map(|i| x.ne[i] as usize);
    let plan = Plan::new(input, k.ne[3] as usize, geometry, nth.max(1) as usize);
    let items = thread_share(plan.items(), ith, nth);
    if items.is_empty() {
        return;
    }
    let [kernel_len, input_len, out_len] = plan.scratch();
    let taps = plan.kw * plan.kh;
    // SAFETY: the kernel holds KW*KH*C*OC f16 or f32 values, contiguous (`covers`).
    let kernel = unsafe { F32Source::of(k, taps * plan.c * plan.oc) };
    // SAFETY: the bias, when present, holds OC f32 values (checked by `conv_2d_host`).
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.data as *const f32, plan.oc) });
    let source = Source {
        data: x.data as *const u8,
        nb: [x.nb[1], x.nb[2], x.nb[3]],
    };
    with_scratch(kernel_len + input_len + out_len, |buf| {
        let (weights, rest) = buf.split_at_mut(kernel_len);
        let (block_in, block_out) = rest.split_at_mut(input_len);
        let mut row = vec![0f32; taps * plan.c];
        let mut converted = None;
        for i in items {
            let (chunk, image, block) = plan.item(i);
            let oc0 = chunk * plan.chunk;
            let ocs = plan.chunk.min(plan.oc - oc0);
            if converted != Some(chunk) {
                plan.tap_major(kernel, oc0, ocs, &mut row, weights);
                converted = Some(chunk);
            }
            let y0 = block * plan.rows;
            let rows = plan.rows.min(plan.oh - y0);
            // SAFETY: the source is the live input (rows of W f32 values, strides nb).
            unsafe { source.fill(&plan, image, y0, rows, block_in) };
            plan.block(weights, block_in, block_out, ocs, rows);
            let plane = plan.ow * plan.oh;
            for o in 0..ocs {
                let b = bias.map(|b| b[oc0 + o]);
                let base = (image * plan.oc + oc0 + o) * plane + y0 * plan.ow;
                for r in 0..rows {
                    let src = &block_out[o * plan.rows * plan.pw + r * plan.pw..][..plan.ow];
                    // SAFETY: dst is `[OW, OH, OC, N]` f32, contiguous (built so); this row
                    // belongs to this item alone.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            (d.data as *mut f32).add(base + r * plan.ow),
                            plan.ow,
                        )
                    };
                    match b {
                        Some(b) => {
                            for (d, s) in dst.iter_mut().zip(src) {
                                *d = s + b;
                            }
                        }
                        None => dst.copy_from_slice(src),
                    }
                }
            }
        }
    });
}

impl Plan {
    /// The `KH KW` products of one block (`rows` output rows, `ocs` output channels) into
    /// `out` (`[ocs][rows * PW]`, row stride `self.rows * PW`).
    fn block(&self, weights: &[f32], input: &[f32], out: &mut [f32], ocs: usize, rows: usize) {
        let plane = (rows + self.kh - 1) * self.pw;
        // Output pixels of the padded grid; the last row's columns past OW are not computed
        // (they would read past the block's last input row).
        let pixels = (rows - 1) * self.pw + self.ow;
        let ld = self.rows * self.pw;
        assert!(input.len() >= self.c * plane && out.len() >= (ocs - 1) * ld + pixels);
        assert!(weights.len() >= self.kw * self.kh * ocs * self.c);
        for ky in 0..self.kh {
            for kx in 0..self.kw {
                let tap = ky * self.kw + kx;
                // SAFETY: the largest value read is channel C-1's at (KH-1+rows-1) PW + OW-1 +
                // KW-1 = (rows+KH-1) PW - 1, the plane's last (checked above); the kernel
                // slice [ocs, C] lies inside `weights`, the output [ocs, pixels] (row
                // stride ld) inside `out`.
                unsafe {
                    gemm::gemm(
                        ocs,
                        pixels,
                        self.c,
                        out.as_mut_ptr(),
                        1,
                        ld as isize,
                        tap > 0,
                        weights.as_ptr().add(tap * ocs * self.c),
                        1,
                        self.c as isize,
                        input.as_ptr().add(ky * self.pw + kx),
                        1,
                        plane as isize,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
        }
    }
}

impl Plan {
    /// Output channels `oc0..oc0 + ocs` of `kernel` (`[KW, KH, C, OC]`) as f32, tap-major
    /// (`out[tap][o][c]`); `row` holds one output channel's `KH KW C` values when they need
    /// converting.
    fn tap_major(
        &self,
        kernel: F32Source,
        oc0: usize,
        ocs: usize,
        row: &mut [f32],
        out: &mut [f32],
    ) {
        let taps = self.kw * self.kh;
        let len = taps * self.c;
        for o in 0..ocs {
            let at = (oc0 + o) * len;
            let row = kernel.f32_values(at..at + len, row);
            // Tap by tap: sequential writes, reads `taps` apart within the row (in L1).
            for tap in 0..taps {
                let dst = &mut out[(tap * ocs + o) * self.c..][..self.c];
                for (d, s) in dst.iter_mut().zip(row[tap..].iter().step_by(taps)) {
                    *d = *s;
                }
            }
        }
    }
}

/// The input tensor's data and byte strides (row, channel, image).
struct Source {
    data: *const u8,
    nb: [usize; 3],
}

impl Source {
    /// Copies the padded input rows of output rows `y0..y0 + rows` of `image` (all channels)
    /// into `out`: `[C][rows + KH - 1][PW]`, zeros outside the input.
    ///
    /// # Safety
    /// `data` is the live input `[W, H, C, N]` (f32, contiguous rows, strides `nb`).
    unsafe fn fill(&self, plan: &Plan, image: usize, y0: usize, rows: usize, out: &mut [f32]) {
        let in_rows = rows + plan.kh - 1;
        let plane = in_rows * plan.pw;
        for ci in 0..plan.c {
            for r in 0..in_rows {
                let dst = &mut out[ci * plane + r * plan.pw..][..plan.pw];
                let y = (y0 + r).checked_sub(plan.py).filter(|y| *y < plan.h);
                match y {
                    Some(y) => {
                        dst[..plan.px].fill(0.0);
                        dst[plan.px + plan.w..].fill(0.0);
                        // SAFETY: row y of channel ci of image `image` holds W f32 values.
                        let src = unsafe {
                            std::slice::from_raw_parts(
                                self.data
                                    .add(image * self.nb[2] + ci * self.nb[1] + y * self.nb[0])
                                    as *const f32,
                                plan.w,
                            )
                        };
                        dst[plan.px..plan.px + plan.w].copy_from_slice(src);
                    }
                    None => dst.fill(0.0),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(k: usize, pad: usize) -> Im2colGeometry {
        Im2colGeometry::new((1, 1), (pad, pad), (1, 1), (k, k)).unwrap()
    }

    #[test]
    fn plans_cover_every_output_row_and_channel_once() {
        for (input, oc, k, pad, nth) in [
            ([64, 64, 320, 2], 320, 3, 1, 2),
            ([512, 512, 128, 1], 128, 3, 1, 2),
            ([32, 32, 1280, 2], 1280, 3, 1, 16),
            ([40, 13, 5, 1], 7, 3, 1, 3),
            ([64, 64, 320, 1], 4, 1, 0, 2),
        ] {
            let p = Plan::new(input, oc, geometry(k, pad), nth);
            let mut rows = vec![0; p.oh * p.n * oc];
            for i in 0..p.items() {
                let (chunk, image, block) = p.item(i);
                let oc0 = chunk * p.chunk;
                let y0 = block * p.rows;
                for o in oc0..(oc0 + p.chunk).min(oc) {
                    for y in y0..(y0 + p.rows).min(p.oh) {
                        rows[(o * p.n + image) * p.oh + y] += 1;
                    }
                }
            }
            assert!(rows.iter().all(|v| *v == 1), "{p:?}");
            let [k_len, in_len, _] = p.scratch();
            assert!(
                k_len <= KERNEL_CHUNK_VALUES.max(16 * input[2] * k * k),
                "{p:?}"
            );
            assert!(
                in_len <= BLOCK_INPUT_VALUES.max((k + 1) * p.pw * input[2]),
                "{p:?}"
            );
            assert!(
                p.items() >= nth.min(p.n * p.blocks * oc.div_ceil(16)),
                "{p:?}"
            );
        }
    }

    #[test]
    fn small_or_strided_convolutions_keep_the_im2col() {
        let f16 = Some(DType::F16);
        assert!(covers(
            [3, 3, 320, 320],
            f16,
            true,
            [64, 64, 320, 2],
            geometry(3, 1)
        ));
        assert!(!covers(
            [3, 3, 320, 320],
            f16,
            true,
            [16, 16, 320, 2],
            geometry(3, 1)
        ));
        assert!(!covers(
            [3, 3, 320, 320],
            f16,
            false,
            [64, 64, 320, 2],
            geometry(3, 1)
        ));
        assert!(!covers(
            [3, 3, 320, 320],
            Some(DType::BF16),
            true,
            [64, 64, 320, 2],
            geometry(3, 1)
        ));
        let strided = Im2colGeometry::new((2, 2), (1, 1), (1, 1), (3, 3)).unwrap();
        assert!(!covers(
            [3, 3, 320, 320],
            f16,
            true,
            [64, 64, 320, 2],
            strided
        ));
    }
}
