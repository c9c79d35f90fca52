//! Two steps of a 2-D convolution as CPU kernels of this crate, run by ggml as custom ops
//! (`ggml_custom_4d`) on the CPU backend: the im2col before the matrix product, and the
//! epilogue after it.
//!
//! **The im2col.**
//! ggml's own CPU im2col walks every output pixel, then every input channel (the channels
//! shared among the threads in turn, so that neighbouring threads write the same cache
//! lines), then every kernel tap with a bounds check and a scalar conversion: on the
//! SD-family UNets it took a third of the convolutions' time (a profile of the tiny UNet
//! step, `sd-bench unet --config tiny`: 21.7% im2col against 45% GEMM). This kernel gives
//! each thread whole output rows, fills them in tiles of output pixels that stay in cache,
//! reads each input row once per tile and kernel row, and has a branch-free path for the
//! interior taps. It writes exactly ggml's layout and values (`[IC*KH*KW, OW, OH, N]`,
//! f32 -> f16 rounded to nearest even, zeros in the padding), so a graph gives the same bits
//! with either.
//!
//! **The epilogue** ([`epilogue_kernel`]): the product comes out as `[N*OH*OW, OC]`; the
//! convolution's result is `[OW, OH, OC, N]` plus the bias per channel. ggml does that as a
//! permute + copy and a broadcast add, and its add of a `[1, 1, OC, 1]` bias calls its vector
//! routine once per element. The epilogue moves each `OH*OW` plane once and adds its
//! channel's bias on the way, with the same float additions (the same bits).
//!
//! **The channel affine** ([`channel_affine_kernel`]): a group norm's `x * weight + bias`
//! and a resnet's time-embedding add broadcast `[C]` or `[C, N]` values over `[W, H, C, N]`;
//! ggml's `mul` and `add` do that one element per call of their vector routine. One pass
//! per plane instead, with the same roundings.
//!
//! ggml calls the im2col kernel with the op's userdata pointer; the convolution's geometry is packed
//! into that pointer's value ([`Im2colGeometry::pack`]), so nothing is allocated that the
//! graph would have to keep alive. A custom op runs only on the CPU backend: callers use it
//! for graphs computed there.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;
use half::{bf16, f16};

/// Output pixels filled per tile (their rows of `IC * KH * KW` values stay in cache).
const TILE: usize = 16;

/// A convolution's geometry: strides, paddings, dilations and kernel sizes (x, y), each
/// below 256 so that the whole fits a pointer-sized integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Im2colGeometry {
    pub stride: [u8; 2],
    pub pad: [u8; 2],
    pub dilation: [u8; 2],
    pub kernel: [u8; 2],
}

impl Im2colGeometry {
    /// The geometry, when every value fits a byte and the stride, dilation and kernel are
    /// non-zero (`None`: use ggml's im2col).
    pub fn new(
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        kernel: (usize, usize),
    ) -> Option<Im2colGeometry> {
        let b = |v: usize| u8::try_from(v).ok();
        let g = Im2colGeometry {
            stride: [b(stride.0)?, b(stride.1)?],
            pad: [b(pad.0)?, b(pad.1)?],
            dilation: [b(dilation.0)?, b(dilation.1)?],
            kernel: [b(kernel.0)?, b(kernel.1)?],
        };
        let nonzero = g
            .stride
            .iter()
            .chain(&g.dilation)
            .chain(&g.kernel)
            .all(|v| *v > 0);
        (nonzero && usize::BITS >= 64).then_some(g)
    }

    /// The geometry as one integer (the custom op's userdata pointer value).
    pub fn pack(self) -> usize {
        let bytes = [
            self.stride[0],
            self.stride[1],
            self.pad[0],
            self.pad[1],
            self.dilation[0],
            self.dilation[1],
            self.kernel[0],
            self.kernel[1],
        ];
        u64::from_le_bytes(bytes) as usize
    }

    /// The geometry [`pack`](Self::pack) stored.
    pub fn unpack(v: usize) -> Im2colGeometry {
        let b = (v as u64).to_le_bytes();
        Im2colGeometry {
            stride: [b[0], b[1]],
            pad: [b[2], b[3]],
            dilation: [b[4], b[5]],
            kernel: [b[6], b[7]],
        }
    }

    /// The output width and height for an input of `w` x `h` (`None` when the dilated
    /// kernel exceeds the padded input).
    pub fn output_size(&self, w: usize, h: usize) -> Option<(usize, usize)> {
        let dim = |n: usize, i: usize| {
            let ext = self.dilation[i] as usize * (self.kernel[i] as usize - 1) + 1;
            let padded = n + 2 * self.pad[i] as usize;
            (padded >= ext).then(|| (padded - ext) / self.stride[i] as usize + 1)
        };
        Some((dim(w, 0)?, dim(h, 1)?))
    }
}

/// A value the kernel writes: f32, f16 or bf16 (converted as ggml converts, to nearest
/// even).
trait Element: Copy {
    const ZERO: Self;
    /// Converts `src` into `dst` (same length).
    fn convert(src: &[f32], dst: &mut [Self]);
}

impl Element for f32 {
    const ZERO: f32 = 0.0;
    fn convert(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Element for f16 {
    const ZERO: f16 = f16::ZERO;
    fn convert(src: &[f32], dst: &mut [f16]) {
        // Vectorised (F16C) where the CPU has it; round to nearest even either way.
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

impl Element for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    fn convert(src: &[f32], dst: &mut [bf16]) {
        // Round to nearest even, NaN kept quiet: ggml's `GGML_FP32_TO_BF16`.
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

/// The custom op: `dst` `[IC*KH*KW, OW, OH, N]` (f32, f16 or bf16) from `dst->src[0]`, the f32
/// input `[W, H, IC, N]` with contiguous rows; thread `ith` of `nth` fills its share of the
/// `N * OH` output rows.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::conv_2d_host` (its source, types and
/// shapes checked there) and `userdata` the packed [`Im2colGeometry`].
pub(crate) unsafe extern "C" fn im2col_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let geometry = Im2colGeometry::unpack(userdata as usize);
    // SAFETY: see the function's contract.
    let (d, s) = unsafe { (&*dst, &*(*dst).src[0]) };
    let job = Job {
        geometry,
        iw: s.ne[0] as usize,
        ih: s.ne[1] as usize,
        ic: s.ne[2] as usize,
        nb: [s.nb[1], s.nb[2], s.nb[3]],
        src: s.data as *const u8,
        k: d.ne[0] as usize,
        ow: d.ne[1] as usize,
        oh: d.ne[2] as usize,
        rows: (d.ne[2] * d.ne[3]) as usize,
    };
    let rows = thread_share(job.rows, ith, nth);
    let (r0, r1) = (rows.start, rows.end);
    if d.type_ == sys::GGML_TYPE_F16 {
        // SAFETY: dst holds `rows * ow * k` f16 values (built so).
        unsafe { job.fill(d.data as *mut f16, r0, r1) }
    } else if d.type_ == sys::GGML_TYPE_BF16 {
        // SAFETY: as above, bf16.
        unsafe { job.fill(d.data as *mut bf16, r0, r1) }
    } else {
        // SAFETY: as above, f32.
        unsafe { job.fill(d.data as *mut f32, r0, r1) }
    }
}

/// The epilogue op: `dst` `[OW, OH, OC, N]` f32 from `dst->src[0]`, the product
/// `[N*OH*OW, OC]` f32 (contiguous), plus `dst->src[1]`, the bias `[OC]` f32, when present;
/// thread `ith` of `nth` does its share of the `OC * N` planes.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::conv_2d_host` (types and shapes
/// checked there).
pub(crate) unsafe extern "C" fn epilogue_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract.
    let d = unsafe { &*dst };
    let plane = (d.ne[0] * d.ne[1]) as usize;
    let (oc, n) = (d.ne[2] as usize, d.ne[3] as usize);
    // SAFETY: src[0] is the product; src[1] the bias or null.
    let (mm, bias) = unsafe { (&*d.src[0], d.src[1].as_ref()) };
    for p in thread_share(oc * n, ith, nth) {
        let (img, c) = (p / oc, p % oc);
        // SAFETY: plane (img, c) of dst starts at (img * oc + c) * plane; in the product,
        // column c (stride nb[1]) holds the N images' planes one after the other.
        let (src, out) = unsafe {
            let s = (mm.data as *const u8).add(c * mm.nb[1]) as *const f32;
            (
                std::slice::from_raw_parts(s.add(img * plane), plane),
                std::slice::from_raw_parts_mut((d.data as *mut f32).add(p * plane), plane),
            )
        };
        // SAFETY: the bias holds `oc` f32 values.
        let shift = bias.map(|b| unsafe { channel_value(b, oc, c, img) });
        affine_plane(src, out, None, shift);
    }
}

/// Row `r` (rows numbered over dims 1-3 in order) of `t`: `n` f32 values at its strides
/// `nb[1..]`.
///
/// # Safety
/// `t` is a live f32 tensor whose rows hold at least `n` contiguous values, and `r` one of
/// its rows.
pub(super) unsafe fn f32_row(t: &sys::ggml_tensor, r: usize, n: usize) -> &[f32] {
    let (n1, n2) = (t.ne[1] as usize, t.ne[2] as usize);
    let (i1, i2, i3) = (r % n1, (r / n1) % n2, r / (n1 * n2));
    let at = i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
    // SAFETY: see the function's contract.
    unsafe { std::slice::from_raw_parts((t.data as *const u8).add(at) as *const f32, n) }
}

/// Thread `ith` of `nth`'s share of `items` items (planes, rows, blocks), as ggml numbers
/// a custom op's threads.
pub(super) fn thread_share(items: usize, ith: c_int, nth: c_int) -> std::ops::Range<usize> {
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    items * ith / nth..items * (ith + 1) / nth
}

/// Work counters of the custom-op calls in progress that hand out their work in chunks:
/// `(key, next item, threads arrived, threads still to leave)`. Few calls run at once (one
/// per computing backend), so a short list under a lock.
type Counters = Vec<(
    usize,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    usize,
    usize,
)>;
static SHARED_COUNTERS: std::sync::Mutex<Counters> = std::sync::Mutex::new(Vec::new());

/// Hands the items `0..total` of one custom-op call out to its `nth` threads in chunks of
/// `grain` items, each chunk to whichever thread asks first, and runs `f` on this thread's
/// chunks: a thread on a faster core takes more of the work than an equal share would give
/// it (this project's 2-core VM has cores 6% apart; hybrid desktop CPUs have cores twice as
/// fast as others), where a static split leaves it waiting at ggml's barrier. `key` names
/// the call (its `dst` tensor's address); every thread of the call passes the same `key`,
/// `total` and `grain`. ggml runs each thread of a custom op exactly once per call, so the
/// counter is dropped when the last thread leaves, before the next op starts.
pub(super) fn claim_chunks(
    key: usize,
    nth: c_int,
    total: usize,
    grain: usize,
    mut f: impl FnMut(std::ops::Range<usize>),
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (nth, grain) = (nth.max(1) as usize, grain.max(1));
    let lock = || SHARED_COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let counter = if nth == 1 {
        std::sync::Arc::new(AtomicUsize::new(0))
    } else {
        let mut list = lock();
        // A call all of whose threads have arrived is not this one (it could only be left
        // over from a call whose threads did not all finish).
        match list
            .iter_mut()
            .find(|(k, _, arrived, _)| *k == key && *arrived < nth)
        {
            Some((_, c, arrived, _)) => {
                *arrived += 1;
                c.clone()
            }
            None => {
                let c = std::sync::Arc::new(AtomicUsize::new(0));
                list.push((key, c.clone(), 1, nth));
                c
            }
        }
    };
    loop {
        let start = counter.fetch_add(grain, Ordering::Relaxed);
        if start >= total {
            break;
        }
        f(start..(start + grain).min(total));
    }
    if nth > 1 {
        let mut list = lock();
        if let Some(i) = list
            .iter()
            .position(|(k, c, ..)| *k == key && std::sync::Arc::ptr_eq(c, &counter))
        {
            list[i].3 -= 1;
            if list[i].3 == 0 {
                list.swap_remove(i);
            }
        }
    }
}

thread_local! {
    /// Each compute thread's scratch for the kernels of this crate that need some (the
    /// attention's score block, the channels-innermost convolution's band and kernel
    /// slices), kept between calls: ggml's compute threads live as long as their backend,
    /// and a fresh block a call cost its page faults and zeroing (2.6% of an SD1.5 step).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` f32 values of this thread's scratch (contents unspecified). The
/// kernels never call one another, so the scratch is never borrowed twice.
pub(super) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with_borrow_mut(|buf| {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

/// A weight's values as the f32 product kernels (`host_conv_implicit.rs`, `host_linear.rs`)
/// read them: f16 or f32, contiguous.
#[derive(Clone, Copy)]
pub(super) enum F32Source<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl<'a> F32Source<'a> {
    /// The first `len` values of `t`: f16 if its type is f16, else f32.
    ///
    /// # Safety
    /// `t` is a live tensor of f16 or f32 holding at least `len` contiguous values.
    pub(super) unsafe fn of(t: &'a sys::ggml_tensor, len: usize) -> F32Source<'a> {
        // SAFETY: see the function's contract.
        unsafe {
            if t.type_ == sys::GGML_TYPE_F16 {
                F32Source::F16(std::slice::from_raw_parts(t.data as *const f16, len))
            } else {
                F32Source::F32(std::slice::from_raw_parts(t.data as *const f32, len))
            }
        }
    }

    /// Values `range` as f32: borrowed when they are f32, else converted into `buf` (at least
    /// `range.len()` values).
    pub(super) fn f32_values<'b>(
        &'b self,
        range: std::ops::Range<usize>,
        buf: &'b mut [f32],
    ) -> &'b [f32] {
        match self {
            F32Source::F16(v) => {
                let out = &mut buf[..range.len()];
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(&v[range], out);
                out
            }
            F32Source::F32(v) => &v[range],
        }
    }
}

/// The value of `t` (f32, `c` values or `c * n`, one set per sample) for channel `ch` of
/// sample `img`.
///
/// # Safety
/// `t` is a live f32 tensor of `c` or `c * n` values, `ch < c`, `img < n`.
unsafe fn channel_value(t: &sys::ggml_tensor, c: usize, ch: usize, img: usize) -> f32 {
    let per_sample = (t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]) as usize > c;
    let i = if per_sample { img * c + ch } else { ch };
    // SAFETY: i < the tensor's element count (see the contract).
    unsafe { *(t.data as *const f32).add(i) }
}

/// `out = src * scale + shift` over one plane, the product rounded before the sum (as
/// ggml's `mul` then `add`; Rust never contracts them into an FMA), either part optional.
fn affine_plane(src: &[f32], out: &mut [f32], scale: Option<f32>, shift: Option<f32>) {
    match (scale, shift) {
        (Some(s), Some(b)) => {
            for (o, v) in out.iter_mut().zip(src) {
                let t = *v * s;
                *o = t + b;
            }
        }
        (Some(s), None) => {
            for (o, v) in out.iter_mut().zip(src) {
                *o = *v * s;
            }
        }
        (None, Some(b)) => {
            for (o, v) in out.iter_mut().zip(src) {
                *o = *v + b;
            }
        }
        (None, None) => out.copy_from_slice(src),
    }
}

/// The channel-affine op ([`crate::ggml::Context::channel_affine`]): `dst` `[W, H, C, N]`
/// f32 = `src[0]` (same shape, contiguous) times `src[1]` plus `src[2]`, per channel: each
/// of them null or `C` or `C * N` f32 values (per sample). The product is rounded before
/// the sum, as ggml's `mul` then `add` compute it (Rust never contracts them into an FMA).
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::channel_affine` (types and shapes
/// checked there).
pub(crate) unsafe extern "C" fn channel_affine_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    _userdata: *mut c_void,
) {
    // SAFETY: see the function's contract.
    let d = unsafe { &*dst };
    let plane = (d.ne[0] * d.ne[1]) as usize;
    let (c, n) = (d.ne[2] as usize, d.ne[3] as usize);
    // SAFETY: src[0] is x; src[1] and src[2] are null or hold `c` or `c * n` f32 values.
    let (x, scale, shift) = unsafe { (&*d.src[0], d.src[1].as_ref(), d.src[2].as_ref()) };
    for p in thread_share(c * n, ith, nth) {
        let (img, ch) = (p / c, p % c);
        // SAFETY: plane p of x and dst (both contiguous `[W, H, C, N]`).
        let (src, out) = unsafe {
            (
                std::slice::from_raw_parts((x.data as *const f32).add(p * plane), plane),
                std::slice::from_raw_parts_mut((d.data as *mut f32).add(p * plane), plane),
            )
        };
        // SAFETY: scale and shift hold `c` or `c * n` f32 values.
        let value =
            |t: Option<&sys::ggml_tensor>| t.map(|t| unsafe { channel_value(t, c, ch, img) });
        affine_plane(src, out, value(scale), value(shift));
    }
}

/// One im2col: the geometry, the input (its rows' byte strides) and the output's shape.
struct Job {
    geometry: Im2colGeometry,
    iw: usize,
    ih: usize,
    ic: usize,
    /// Byte strides of the input's rows, channels and images.
    nb: [usize; 3],
    src: *const u8,
    /// Values per output pixel (`IC * KH * KW`).
    k: usize,
    ow: usize,
    oh: usize,
    /// Output rows (`N * OH`).
    rows: usize,
}

impl Job {
    /// Fills output rows `r0..r1` (row `r` is image `r / OH`, output row `r % OH`).
    ///
    /// # Safety
    /// `out` points to `rows * ow * k` elements; the input to `N` images of `ic` channels of
    /// `ih` rows of `iw` f32 values at the strides `nb`.
    unsafe fn fill<T: Element>(&self, out: *mut T, r0: usize, r1: usize) {
        let g = &self.geometry;
        let (kw, kh) = (g.kernel[0] as usize, g.kernel[1] as usize);
        let (s0, s1) = (g.stride[0] as usize, g.stride[1] as isize);
        let (p0, p1) = (g.pad[0] as isize, g.pad[1] as isize);
        let (d0, d1) = (g.dilation[0] as usize, g.dilation[1] as isize);
        let (iw, ih) = (self.iw as isize, self.ih as isize);
        let k = self.k;
        // One tile's stretch of an input row, converted once, zeros where it pads.
        // One spare value past the longest stretch: the 3x3 path copies 4 at a time.
        let mut stretch = vec![T::ZERO; (TILE - 1) * s0 + (kw - 1) * d0 + 2];
        for r in r0..r1 {
            let (n, y) = (r / self.oh, r % self.oh);
            // SAFETY: row `r` starts at `r * ow * k` inside `out`.
            let row_out = unsafe { out.add(r * self.ow * k) };
            let mut t0 = 0;
            while t0 < self.ow {
                let t1 = (t0 + TILE).min(self.ow);
                // The input columns this tile reads: [base, base + len), clamped to the row.
                let base = (t0 * s0) as isize - p0;
                let len = (t1 - t0 - 1) * s0 + (kw - 1) * d0 + 1;
                let lo = base.max(0).min(iw);
                let hi = (base + len as isize).min(iw).max(lo);
                let (a, b) = ((lo - base) as usize, (hi - base) as usize);
                for c in 0..self.ic {
                    for ky in 0..kh {
                        let iy = y as isize * s1 + ky as isize * d1 - p1;
                        let col = (c * kh + ky) * kw;
                        if iy < 0 || iy >= ih {
                            for x in t0..t1 {
                                // SAFETY: x < ow, col + kw <= k.
                                let o = unsafe {
                                    std::slice::from_raw_parts_mut(row_out.add(x * k + col), kw)
                                };
                                o.fill(T::ZERO);
                            }
                            continue;
                        }
                        // SAFETY: image n, channel c, row iy exist; rows are contiguous f32,
                        // and lo..hi lies inside the row.
                        let src = unsafe {
                            let p = self
                                .src
                                .add(n * self.nb[2] + c * self.nb[1] + iy as usize * self.nb[0])
                                as *const f32;
                            std::slice::from_raw_parts(p.add(lo as usize), (hi - lo) as usize)
                        };
                        stretch[..a].fill(T::ZERO);
                        T::convert(src, &mut stretch[a..b]);
                        stretch[b..len].fill(T::ZERO);
                        if d0 == 1 && kw == 3 && col + 4 <= k {
                            // 3x3 taps but this pixel's last: copy 4 values in one move; the
                            // fourth lands in the pixel's next slot (the next channel or kernel
                            // row), which this loop writes later.
                            for x in t0..t1 {
                                let from = (x - t0) * s0;
                                // SAFETY: x < ow and col + 4 <= k; stretch holds from + 4
                                // values (len + 1 <= its length).
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        stretch.as_ptr().add(from),
                                        row_out.add(x * k + col),
                                        4,
                                    );
                                }
                            }
                            continue;
                        }
                        for x in t0..t1 {
                            let from = (x - t0) * s0;
                            // SAFETY: x < ow, col + kw <= k.
                            let o = unsafe {
                                std::slice::from_raw_parts_mut(row_out.add(x * k + col), kw)
                            };
                            if d0 == 1 && kw == 3 {
                                // The common 3x3 case, unrolled (a 3-value copy_from_slice
                                // is a memmove call).
                                let s = &stretch[from..from + 3];
                                o[0] = s[0];
                                o[1] = s[1];
                                o[2] = s[2];
                            } else if d0 == 1 {
                                o.copy_from_slice(&stretch[from..from + kw]);
                            } else {
                                for (kx, v) in o.iter_mut().enumerate() {
                                    *v = stretch[from + kx * d0];
                                }
                            }
                        }
                    }
                }
                t0 = t1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_packs_into_one_word() {
        let g = Im2colGeometry::new((2, 1), (1, 0), (1, 3), (3, 5)).unwrap();
        assert_eq!(Im2colGeometry::unpack(g.pack()), g);
        assert_eq!(Im2colGeometry::new((256, 1), (0, 0), (1, 1), (3, 3)), None);
        assert_eq!(Im2colGeometry::new((0, 1), (0, 0), (1, 1), (3, 3)), None);
        assert_eq!(g.output_size(8, 16), Some((4, 4)));
        assert_eq!(g.output_size(8, 8), None);
    }

    /// Threads of one call (same key) take every chunk exactly once between them, two calls
    /// at once (other keys) do not mix, a slow thread takes fewer chunks, and the counters
    /// are gone afterwards.
    #[test]
    fn chunks_go_to_the_threads_that_ask_each_once() {
        use std::sync::Mutex;
        let (total, grain, nth) = (1000usize, 7usize, 3usize);
        // Per call: (thread, chunk) as taken.
        type Taken = Mutex<Vec<(usize, std::ops::Range<usize>)>>;
        let seen: Vec<Taken> = (0..2).map(|_| Mutex::new(Vec::new())).collect();
        std::thread::scope(|s| {
            for call in 0..2usize {
                for ith in 0..nth {
                    let seen = &seen[call];
                    s.spawn(move || {
                        claim_chunks(0xA000 + call, nth as c_int, total, grain, |r| {
                            if ith == 0 {
                                std::thread::sleep(std::time::Duration::from_millis(2));
                            }
                            seen.lock().unwrap().push((ith, r));
                        });
                    });
                }
            }
        });
        for call in seen {
            let mut got = call.into_inner().unwrap();
            let slow = got.iter().filter(|(t, _)| *t == 0).count();
            got.sort_by_key(|(_, r)| r.start);
            let mut next = 0;
            for (_, r) in &got {
                assert_eq!(r.start, next);
                assert!(r.end - r.start <= grain && r.end > r.start);
                next = r.end;
            }
            assert_eq!(next, total);
            assert!(
                slow < got.len() / nth,
                "the slow thread took {slow} of {}",
                got.len()
            );
        }
        // (Other tests' calls may hold counters of their own meanwhile.)
        assert!(!SHARED_COUNTERS
            .lock()
            .unwrap()
            .iter()
            .any(|(k, ..)| (0xA000..0xA002).contains(k)));
        // One thread: every chunk, in order, no counter kept.
        let mut one = Vec::new();
        claim_chunks(0xB000, 1, 20, 8, |r| one.push(r));
        assert_eq!(one, [0..8, 8..16, 16..20]);
    }
}
