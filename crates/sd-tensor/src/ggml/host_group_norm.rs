//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): a group norm
//! with its per-channel scale and shift, and optionally the SiLU after it (a UNet's and a
//! VAE's `silu(norm(x))`), in one op.
//!
//! **Why.** With ggml's ops this is a `group_norm` (a pass for the mean, one writing
//! `x - mean` and summing its squares, one scaling it), this crate's `channel_affine` and a
//! `silu`: five reads and four writes of an activation that at an SD1.5 UNet's 64x64 level
//! is 10 MB, about 2.5% of a bf16 step on the AMX tiles (`perf`, 2026-12-07). This kernel
//! reads each group twice for its statistics and once more to write the result.
//!
//! **Numerics** as PyTorch's `GroupNorm` and ggml's: the mean, then the biased variance of
//! `x - mean` (two passes, not the sum of squares less the squared mean), `eps` added to
//! it; sums in f32 lanes of 16, added up in f64. The SiLU is `x / (1 + e^-x)` with `e^-|x|`
//! by this crate's `exp_nonpositive` (a few ulp).

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

use super::host_attention::exp_nonpositive;
use super::host_conv::thread_share;

/// What the op's `userdata` carries: the group count, whether a SiLU follows, `eps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct GroupNormSpec {
    pub groups: u32,
    pub silu: bool,
    pub eps: f32,
}

impl GroupNormSpec {
    /// Packed into a pointer-sized integer: `eps`'s bits high, the groups (31 bits) and
    /// the SiLU flag low.
    pub(crate) fn pack(self) -> usize {
        ((self.eps.to_bits() as u64) << 32 | (self.groups as u64) << 1 | self.silu as u64) as usize
    }

    fn unpack(v: usize) -> GroupNormSpec {
        let v = v as u64;
        GroupNormSpec {
            groups: ((v >> 1) & 0x7fff_ffff) as u32,
            silu: v & 1 == 1,
            eps: f32::from_bits((v >> 32) as u32),
        }
    }
}

/// The sum of `x` in 16 f32 lanes, the lanes added in f64.
#[inline(always)]
fn lane_sum(x: &[f32], mut f: impl FnMut(f32) -> f32) -> f64 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += f(*v);
        }
    }
    acc.iter().map(|a| *a as f64).sum::<f64>() + rest.iter().map(|v| f(*v) as f64).sum::<f64>()
}

/// `x * sigmoid(x)`, branch-free.
#[inline(always)]
fn silu(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    let r = 1.0 / (1.0 + e);
    // sigmoid(x) = 1 / (1 + e^-x): r for x >= 0, e r below.
    x * if x >= 0.0 { r } else { e * r }
}

/// One group: `group` holds its channels' planes (`plane` values each) one after another;
/// `out` the same places of the output; `scale`/`shift` its channels' affine values.
#[inline(always)]
fn normalise_group(
    group: &[f32],
    out: &mut [f32],
    plane: usize,
    scale: &[f32],
    shift: &[f32],
    spec: GroupNormSpec,
) {
    let n = group.len() as f64;
    let mean = lane_sum(group, |v| v) / n;
    let m = mean as f32;
    let var = lane_sum(group, |v| (v - m) * (v - m)) / n;
    let rstd = (1.0 / (var + spec.eps as f64).sqrt()) as f32;
    for (c, (src, dst)) in group
        .chunks_exact(plane)
        .zip(out.chunks_exact_mut(plane))
        .enumerate()
    {
        let a = rstd * scale[c];
        let b = shift[c] - m * a;
        if spec.silu {
            for (y, x) in dst.iter_mut().zip(src) {
                *y = silu(x.mul_add(a, b));
            }
        } else {
            for (y, x) in dst.iter_mut().zip(src) {
                *y = x.mul_add(a, b);
            }
        }
    }
}

/// [`normalise_group`] compiled for AVX-512 (the README's build is baseline x86-64).
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn normalise_group_avx512(
    group: &[f32],
    out: &mut [f32],
    plane: usize,
    scale: &[f32],
    shift: &[f32],
    spec: GroupNormSpec,
) {
    normalise_group(group, out, plane, scale, shift, spec)
}

/// The custom op: `dst` `[W, H, C, N]` f32 from `src[0]` (the same shape, contiguous),
/// `src[1]` and `src[2]` the `C` scales and shifts (f32, contiguous); `userdata` a packed
/// [`GroupNormSpec`]. Thread `ith` of `nth` takes a share of the `N * groups` groups.
///
/// # Safety
/// Called by ggml on a `dst` built by `Context::group_norm_host`, which checked the shapes
/// and types.
pub(crate) unsafe extern "C" fn group_norm_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let spec = GroupNormSpec::unpack(userdata as usize);
    // SAFETY: see the function's contract.
    let (d, x, s, b) = unsafe {
        let d = &*dst;
        (d, &*d.src[0], &*d.src[1], &*d.src[2])
    };
    let plane = (d.ne[0] * d.ne[1]) as usize;
    let (c, n) = (d.ne[2] as usize, d.ne[3] as usize);
    let groups = spec.groups as usize;
    let per = c / groups;
    // SAFETY: `c` f32 values each.
    let (scale, shift) = unsafe {
        (
            std::slice::from_raw_parts(s.data as *const f32, c),
            std::slice::from_raw_parts(b.data as *const f32, c),
        )
    };
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("fma");
    for item in thread_share(n * groups, ith, nth) {
        let (img, g) = (item / groups, item % groups);
        let at = (img * c + g * per) * plane;
        let len = per * plane;
        // SAFETY: the group's channels of image `img` in x and dst (both contiguous);
        // this thread alone writes them.
        let (src, out) = unsafe {
            (
                std::slice::from_raw_parts((x.data as *const f32).add(at), len),
                std::slice::from_raw_parts_mut((d.data as *mut f32).add(at), len),
            )
        };
        let (sc, sh) = (&scale[g * per..][..per], &shift[g * per..][..per]);
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: the CPU has AVX-512 F and FMA.
            unsafe { normalise_group_avx512(src, out, plane, sc, sh, spec) };
            continue;
        }
        normalise_group(src, out, plane, sc, sh, spec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_survives_its_packing() {
        for spec in [
            GroupNormSpec {
                groups: 32,
                silu: true,
                eps: 1e-5,
            },
            GroupNormSpec {
                groups: 1,
                silu: false,
                eps: 1e-6,
            },
        ] {
            assert_eq!(GroupNormSpec::unpack(spec.pack()), spec);
        }
    }

    #[test]
    fn silu_is_x_times_its_sigmoid() {
        for x in [
            -90.0f32, -20.0, -3.5, -1e-3, 0.0, 1e-3, 0.7, 4.0, 30.0, 100.0,
        ] {
            let want = x as f64 / (1.0 + (-x as f64).exp());
            let got = silu(x) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-30) + 1e-37,
                "{x}: {got} vs {want}"
            );
        }
    }
}
