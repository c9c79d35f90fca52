//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): the "same"
//! convolution of channels-innermost activations (`[C, W, H, 1]`, the layout the ESRGAN
//! upscalers compute in) as matrix products straight over the zero-padded input, without
//! an im2col matrix.
//!
//! **Why no im2col.** With channels innermost, the `k` horizontally adjacent pixels of a
//! padded row are `k C` contiguous values, and the next output pixel's window starts `C`
//! values later. So for kernel row `ky` the im2col matrix is a strided view of the padded
//! input itself: row `q` (an output pixel in the padded grid, `q = y PW + x`) starts at
//! `(q + ky PW) C`, rows `C` apart, `k C` values long. One product per kernel row over that
//! view, summed, is the convolution; the two (`k - 1`) columns of the padded grid that are
//! not output pixels cost `(k - 1) / PW` of extra work and are dropped by the epilogue.
//!
//! **Why the `gemm` crate.** ggml's CPU matrix product (tinyBLAS) takes contiguous operands,
//! so ggml would need the view copied (`[k C, W H, k]`, three times the input), and on the
//! narrow products of a dense block (32 output channels) it ran at a third of the f32 ceiling
//! (57 GFLOP/s on 2 threads, a probe of one `128 -> 32` convolution). `gemm` (the CPU matrix
//! product of candle and faer) takes arbitrary row and column strides, packs its operands
//! itself, picks AVX2 / AVX-512 / NEON at run time, and ran the same product at 90-95
//! GFLOP/s a thread on this project's AVX2 machine.
//!
//! **The op.** Sources: `src[0]` the kernel `[k, k, C, OC]` f32, `src[1]` the bias `[OC]` f32
//! or null, `src[2..]` the pieces of the input, each `[C_j, PW, PH, 1]` f32 contiguous and
//! already zero-padded by `p = (k - 1) / 2`, their channels together `C` in order: a
//! convolution of a concatenation is the sum of the convolutions of its pieces with the
//! matching slices of the kernel, so a dense block never copies its growing concatenation.
//! Each thread takes a share of the output rows in bands that stay in cache, packs the
//! kernel slices it needs (`[k C_j, OC]` per piece and kernel row), accumulates the products
//! of every piece and kernel row into the band, then adds the bias and applies the optional
//! LeakyReLU on the way out. The output is `[OC, W, H, 1]`, or `[OC, PW, PH, 1]` with a zero
//! border of `p` (ready to be the next convolution's piece). The geometry and activation are
//! packed into the userdata pointer's value ([`CwhSpec::pack`]).
//!
//! The sums run in another order than ggml's product: results agree with ggml's to f32
//! rounding, not bit for bit.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

/// Output values a thread's band holds at most (256 KiB of f32: the band stays in L2).
const BAND_VALUES: usize = 64 * 1024;

/// Sources before the pieces: the kernel and the bias.
pub(crate) const FIXED_SOURCES: usize = 2;

/// A channels-innermost convolution's kernel size and epilogue, packed into the custom
/// op's userdata.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CwhSpec {
    /// Kernel width and height (odd); the padding is `(kernel - 1) / 2`.
    pub kernel: u8,
    /// Whether the output keeps a zero border of the padding.
    pub padded_out: bool,
    /// LeakyReLU slope applied after the bias (`None`: no activation).
    pub leaky_slope: Option<f32>,
}

impl CwhSpec {
    /// The spec as one integer (the custom op's userdata pointer value): the slope's bits,
    /// then the kernel size and two flags.
    pub fn pack(self) -> usize {
        let slope = self.leaky_slope.map_or(0, f32::to_bits) as u64;
        let v = slope
            | (self.kernel as u64) << 32
            | (self.padded_out as u64) << 40
            | (self.leaky_slope.is_some() as u64) << 41;
        v as usize
    }

    /// The spec [`pack`](Self::pack) stored.
    pub fn unpack(v: usize) -> CwhSpec {
        let v = v as u64;
        CwhSpec {
            kernel: (v >> 32) as u8,
            padded_out: v >> 40 & 1 == 1,
            leaky_slope: (v >> 41 & 1 == 1).then(|| f32::from_bits(v as u32)),
        }
    }
}

/// One piece of the input: its channels, its data and where its channels start in the kernel.
struct Piece {
    channels: usize,
    data: *const f32,
    first_channel: usize,
}

/// The custom op (see the module doc): thread `ith` of `nth` computes its share of the
/// output rows.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::conv_2d_cwh` (sources, types and
/// shapes checked there) and `userdata` the packed [`CwhSpec`].
pub(crate) unsafe extern "C" fn conv_cwh_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let spec = CwhSpec::unpack(userdata as usize);
    // SAFETY: see the function's contract: src[0] the kernel, src[1] the bias or null,
    // src[2..] the pieces up to the first null.
    let (d, kernel, bias) = unsafe { (&*dst, &*(*dst).src[0], (*dst).src[1].as_ref()) };
    let mut pieces = Vec::new();
    let mut first_channel = 0;
    for s in &d.src[FIXED_SOURCES..] {
        // SAFETY: a non-null source is a live piece.
        let Some(s) = (unsafe { s.as_ref() }) else {
            break;
        };
        let channels = s.ne[0] as usize;
        pieces.push(Piece {
            channels,
            data: s.data as *const f32,
            first_channel,
        });
        first_channel += channels;
    }
    // SAFETY: the first piece exists and gives the padded size.
    let p0 = unsafe { &*d.src[FIXED_SOURCES] };
    let k = spec.kernel as usize;
    let pad = (k - 1) / 2;
    let (pw, ph) = (p0.ne[1] as usize, p0.ne[2] as usize);
    let geometry = Geometry {
        k,
        pad,
        pw,
        w: pw - 2 * pad,
        h: ph - 2 * pad,
        c: kernel.ne[2] as usize,
        oc: kernel.ne[3] as usize,
    };
    let rows = super::host_conv::thread_share(geometry.h, ith, nth);
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    // SAFETY: the kernel holds k*k*C*OC f32 values, the bias OC or is null, dst is built
    // for the spec's output form.
    unsafe {
        let bias = bias.map(|b| std::slice::from_raw_parts(b.data as *const f32, geometry.oc));
        let kernel =
            std::slice::from_raw_parts(kernel.data as *const f32, k * k * geometry.c * geometry.oc);
        geometry.run(
            &pieces,
            kernel,
            bias,
            spec,
            d.data as *mut f32,
            rows,
            ith == 0,
            ith + 1 == nth,
        );
    }
}

/// The sizes of one convolution (see the module doc).
struct Geometry {
    k: usize,
    pad: usize,
    /// Padded input width.
    pw: usize,
    /// Output width and height.
    w: usize,
    h: usize,
    /// Input channels (all pieces) and output channels.
    c: usize,
    oc: usize,
}

impl Geometry {
    /// Computes output rows `rows` into `out`; `top` / `bottom`: this share also writes the
    /// padded output's top / bottom border rows.
    ///
    /// # Safety
    /// The pieces hold `[channels, PW, H + 2 pad]` f32 values each; `out` holds the output
    /// (`[OC, W, H]`, or `[OC, PW, H + 2 pad]` when `spec.padded_out`).
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        pieces: &[Piece],
        kernel: &[f32],
        bias: Option<&[f32]>,
        spec: CwhSpec,
        out: *mut f32,
        rows: std::ops::Range<usize>,
        top: bool,
        bottom: bool,
    ) {
        let (k, pw, oc) = (self.k, self.pw, self.oc);
        if spec.padded_out {
            // SAFETY: the border rows lie inside the padded output.
            unsafe {
                let row = pw * oc;
                if top {
                    std::ptr::write_bytes(out, 0, self.pad * row);
                }
                if bottom {
                    std::ptr::write_bytes(out.add((self.pad + self.h) * row), 0, self.pad * row);
                }
            }
        }
        if rows.is_empty() {
            return;
        }
        let band_rows = (BAND_VALUES / (pw * oc)).max(1);
        let band_len = band_rows * pw * oc;
        super::host_conv::with_scratch(band_len + k * k * self.c * oc, |buf| {
            let (band, packed) = buf.split_at_mut(band_len);
            // The kernel slices, [k C_j, OC] row-major per piece and kernel row, one after the
            // other (kernel element (kx, ky, ci, o) at kx + ky k + ci k k + o k k C).
            let mut at = 0;
            for p in pieces {
                for ky in 0..k {
                    for kx in 0..k {
                        for ci in 0..p.channels {
                            let base = kx + ky * k + (p.first_channel + ci) * k * k;
                            for (o, v) in packed[at..at + oc].iter_mut().enumerate() {
                                *v = kernel[base + o * k * k * self.c];
                            }
                            at += oc;
                        }
                    }
                }
            }
            // SAFETY: see this function's contract.
            unsafe { self.bands(pieces, packed, band, band_rows, bias, spec, out, rows) }
        });
    }

    /// The output rows `rows`, `band_rows` at a time in `band`, from the kernel slices
    /// `packed` (see [`Geometry::run`]).
    ///
    /// # Safety
    /// As [`Geometry::run`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn bands(
        &self,
        pieces: &[Piece],
        packed: &[f32],
        band: &mut [f32],
        band_rows: usize,
        bias: Option<&[f32]>,
        spec: CwhSpec,
        out: *mut f32,
        rows: std::ops::Range<usize>,
    ) {
        let (k, pw, oc) = (self.k, self.pw, self.oc);
        let mut y0 = rows.start;
        while y0 < rows.end {
            let y1 = (y0 + band_rows).min(rows.end);
            // Output pixels y0..y1 in the padded grid: the last row's border columns are not
            // computed (they would read past the input's last row).
            let m = (y1 - y0 - 1) * pw + self.w;
            let mut first = true;
            let mut at = 0;
            for p in pieces {
                for ky in 0..k {
                    let rhs = &packed[at..at + k * p.channels * oc];
                    at += rhs.len();
                    // SAFETY: lhs row q reads k*C_j values from ((y0 + ky) PW + q) C_j; the
                    // last, q = m - 1, ends inside padded row y1 - 1 + ky <= H + 2 pad - 1.
                    unsafe {
                        gemm::gemm(
                            m,
                            oc,
                            k * p.channels,
                            band.as_mut_ptr(),
                            1,
                            oc as isize,
                            !first,
                            p.data.add((y0 + ky) * pw * p.channels),
                            1,
                            p.channels as isize,
                            rhs.as_ptr(),
                            1,
                            oc as isize,
                            1.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                    first = false;
                }
            }
            for y in y0..y1 {
                let (at, zero_border) = if spec.padded_out {
                    ((y + self.pad) * pw + self.pad, true)
                } else {
                    (y * self.w, false)
                };
                // SAFETY: output row y: w pixels of oc values from `at`, inside `out`; with a
                // border, `pad` pixels either side are inside the padded row.
                let row = unsafe { std::slice::from_raw_parts_mut(out.add(at * oc), self.w * oc) };
                let src = &band[(y - y0) * pw * oc..][..self.w * oc];
                epilogue(src, row, bias, spec.leaky_slope, oc);
                if zero_border {
                    // SAFETY: as above.
                    unsafe {
                        std::ptr::write_bytes(out.add((at - self.pad) * oc), 0, self.pad * oc);
                        std::ptr::write_bytes(out.add((at + self.w) * oc), 0, self.pad * oc);
                    }
                }
            }
            y0 = y1;
        }
    }
}

/// One output row: `out = act(src + bias)` per pixel of `oc` channels.
fn epilogue(src: &[f32], out: &mut [f32], bias: Option<&[f32]>, slope: Option<f32>, oc: usize) {
    for (o, s) in out.chunks_exact_mut(oc).zip(src.chunks_exact(oc)) {
        match bias {
            Some(b) => {
                for ((o, s), b) in o.iter_mut().zip(s).zip(b) {
                    *o = s + b;
                }
            }
            None => o.copy_from_slice(s),
        }
        if let Some(a) = slope {
            for v in o.iter_mut() {
                if *v < 0.0 {
                    *v *= a;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_packs_into_one_word() {
        for spec in [
            CwhSpec {
                kernel: 3,
                padded_out: true,
                leaky_slope: Some(0.2),
            },
            CwhSpec {
                kernel: 1,
                padded_out: false,
                leaky_slope: None,
            },
            CwhSpec {
                kernel: 7,
                padded_out: false,
                leaky_slope: Some(-0.0),
            },
        ] {
            assert_eq!(CwhSpec::unpack(spec.pack()), spec);
        }
    }
}
