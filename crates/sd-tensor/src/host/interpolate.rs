//! Resampling over the last two dims, matching torch `F.interpolate` on the CPU (output size
//! given): `nearest`, `nearest-exact`, `bilinear` and `bicubic` without antialiasing, and
//! `bilinear`/`bicubic` with `antialias=True` (the separable filter of PIL's resize, which
//! torch follows).
//!
//! Index and weight arithmetic is done in f32 exactly as torch's CPU kernels do it (including
//! their special cases for equal and doubled sizes), so results agree to rounding.

use super::element::Element;
use super::shape::ShapeError;
use super::tensor::{Result, Tensor};

/// Source index of output index `i` for `nearest` (torch `nearest_idx`).
fn nearest_index(i: usize, in_size: usize, out_size: usize) -> usize {
    if out_size == in_size {
        i
    } else if out_size == 2 * in_size {
        i >> 1
    } else {
        let scale = in_size as f32 / out_size as f32;
        ((i as f32 * scale).floor() as usize).min(in_size - 1)
    }
}

/// Source index of output index `i` for `nearest-exact` (torch
/// `nearest_neighbor_exact_compute_source_index`: the pixel under the output pixel's centre).
fn nearest_exact_index(i: usize, in_size: usize, out_size: usize) -> usize {
    let scale = in_size as f32 / out_size as f32;
    (((i as f32 + 0.5) * scale).floor() as usize).min(in_size - 1)
}

/// One output index's taps: the first source index and the weights of consecutive sources.
/// Indices past either border are clamped (bicubic) or excluded (antialiased filters).
#[derive(Clone, Debug)]
pub(super) struct Taps {
    pub(super) first: usize,
    pub(super) weights: Vec<f64>,
}

/// Cubic convolution weights of the four taps around fraction `t` (Keys' kernel with
/// parameter `a`: torch's `get_cubic_upsample_coefficients` uses -0.75).
fn cubic_weights(t: f32, a: f32) -> [f32; 4] {
    let near = |x: f32| ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    let far = |x: f32| ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

/// Taps of torch `bicubic` (`antialias=False`): four sources around the mapped position,
/// indices clamped to the borders, as `upsample_bicubic2d`.
fn cubic_taps(in_size: usize, out_size: usize, align_corners: bool) -> Vec<Vec<(usize, f32)>> {
    let scale = if align_corners {
        if out_size > 1 {
            (in_size - 1) as f32 / (out_size - 1) as f32
        } else {
            0.0
        }
    } else {
        in_size as f32 / out_size as f32
    };
    let last = in_size as i64 - 1;
    (0..out_size)
        .map(|i| {
            let real = if align_corners {
                scale * i as f32
            } else {
                scale * (i as f32 + 0.5) - 0.5
            };
            let index = (real.floor() as i64).min(last);
            let t = (real - index as f32).clamp(0.0, 1.0);
            let w = cubic_weights(t, -0.75);
            (0..4)
                .map(|k| ((index - 1 + k as i64).clamp(0, last) as usize, w[k]))
                .collect()
        })
        .collect()
}

/// The filter of an antialiased resampling (torch `antialias=True`, PIL's resize).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResampleFilter {
    /// The triangle filter (torch `bilinear` with `antialias=True`, PIL `BILINEAR`).
    Triangle,
    /// Keys' cubic with a = -0.5 (torch `bicubic` with `antialias=True`, PIL `BICUBIC`).
    Cubic,
    /// Lanczos with three lobes (PIL `LANCZOS`).
    Lanczos3,
}

impl ResampleFilter {
    /// Half the filter's width in source pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            ResampleFilter::Triangle => 1.0,
            ResampleFilter::Cubic => 2.0,
            ResampleFilter::Lanczos3 => 3.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            ResampleFilter::Triangle => (1.0 - x).max(0.0),
            ResampleFilter::Cubic => {
                let a = -0.5;
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
            ResampleFilter::Lanczos3 => {
                if x < 3.0 {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        1.0
    } else {
        let px = std::f64::consts::PI * x;
        px.sin() / px
    }
}

/// Taps of an antialiased resampling of `in_size` to `out_size` with `filter` (the filter is
/// stretched by the scale when shrinking; sources past the borders are left out and the
/// weights normalised), as PIL's `precompute_coeffs` and torch's `_upsample_*_aa`.
pub(super) fn filter_taps(in_size: usize, out_size: usize, filter: ResampleFilter) -> Vec<Taps> {
    let scale = in_size as f64 / out_size as f64;
    let stretch = scale.max(1.0);
    let support = filter.support() * stretch;
    (0..out_size)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let end = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let raw: Vec<f64> = (first..end)
                .map(|j| filter.weight((j as f64 - center + 0.5) / stretch))
                .collect();
            let total: f64 = raw.iter().sum();
            let weights = raw
                .iter()
                .map(|&w| if total != 0.0 { w / total } else { w })
                .collect();
            Taps { first, weights }
        })
        .collect()
}

/// Applies per-output-index taps along one axis of `planes` planes of `rows` x `cols` f32
/// values: along the columns (`horizontal`) or along the rows.
fn apply_taps(
    src: &[f32],
    planes: usize,
    rows: usize,
    cols: usize,
    taps: &[Taps],
    horizontal: bool,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(planes * taps.len() * if horizontal { rows } else { cols });
    for p in 0..planes {
        let plane = &src[p * rows * cols..(p + 1) * rows * cols];
        if horizontal {
            for r in 0..rows {
                let row = &plane[r * cols..(r + 1) * cols];
                out.extend(taps.iter().map(|t| {
                    let s = &row[t.first..t.first + t.weights.len()];
                    s.iter()
                        .zip(&t.weights)
                        .map(|(v, &w)| v * w as f32)
                        .sum::<f32>()
                }));
            }
        } else {
            for t in taps {
                let mut acc = vec![0f32; cols];
                for (k, &w) in t.weights.iter().enumerate() {
                    let row = &plane[(t.first + k) * cols..(t.first + k + 1) * cols];
                    let w = w as f32;
                    acc.iter_mut().zip(row).for_each(|(a, v)| *a += v * w);
                }
                out.extend(acc);
            }
        }
    }
    out
}

/// Source indices and weights `(i0, i1, w0, w1)` of every output index for `bilinear`
/// (torch `compute_source_index_and_lambda`).
fn linear_taps(
    in_size: usize,
    out_size: usize,
    align_corners: bool,
) -> Vec<(usize, usize, f32, f32)> {
    if in_size == out_size {
        return (0..out_size).map(|i| (i, i, 1.0, 0.0)).collect();
    }
    let scale = if align_corners {
        if out_size > 1 {
            (in_size - 1) as f32 / (out_size - 1) as f32
        } else {
            0.0
        }
    } else {
        in_size as f32 / out_size as f32
    };
    (0..out_size)
        .map(|i| {
            let src = if align_corners {
                scale * i as f32
            } else {
                (scale * (i as f32 + 0.5) - 0.5).max(0.0)
            };
            let i0 = (src.floor() as usize).min(in_size - 1);
            let l1 = (src - i0 as f32).clamp(0.0, 1.0);
            let i1 = if i0 < in_size - 1 { i0 + 1 } else { i0 };
            (i0, i1, 1.0 - l1, l1)
        })
        .collect()
}

impl<T> Tensor<T> {
    /// Checks a resampling request; returns (planes, in_h, in_w) and the output shape.
    fn resample_dims(
        &self,
        op: &'static str,
        out_h: usize,
        out_w: usize,
    ) -> Result<(usize, usize, usize, Vec<usize>)> {
        let shape = self.shape();
        let invalid = |detail: String| ShapeError::Invalid {
            op,
            shape: shape.to_vec(),
            detail,
        };
        if shape.len() < 2 {
            return Err(invalid("needs at least 2 dims".into()));
        }
        let (in_h, in_w) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        if in_h == 0 || in_w == 0 || out_h == 0 || out_w == 0 {
            return Err(invalid(format!(
                "cannot resample {in_h}x{in_w} to {out_h}x{out_w}"
            )));
        }
        let planes: usize = shape[..shape.len() - 2].iter().product();
        let mut out_shape = shape.to_vec();
        let r = out_shape.len();
        out_shape[r - 2] = out_h;
        out_shape[r - 1] = out_w;
        if super::shape::checked_numel(&out_shape).is_none() {
            return Err(ShapeError::Overflow { shape: out_shape });
        }
        Ok((planes, in_h, in_w, out_shape))
    }
}

impl<T: Copy> Tensor<T> {
    /// Nearest-neighbour resampling of the last two dims to `out_h` x `out_w`, as torch
    /// `F.interpolate(x, size=(out_h, out_w), mode="nearest")`.
    pub fn interpolate_nearest(&self, out_h: usize, out_w: usize) -> Result<Self> {
        self.gather("interpolate_nearest", out_h, out_w, nearest_index)
    }

    /// Nearest-neighbour resampling taking the source pixel under each output pixel's centre,
    /// as torch `F.interpolate(x, size=(out_h, out_w), mode="nearest-exact")`.
    pub fn interpolate_nearest_exact(&self, out_h: usize, out_w: usize) -> Result<Self> {
        self.gather(
            "interpolate_nearest_exact",
            out_h,
            out_w,
            nearest_exact_index,
        )
    }

    /// Picks, for every output pixel, the source pixel `index(i, in, out)` along each axis.
    fn gather(
        &self,
        op: &'static str,
        out_h: usize,
        out_w: usize,
        index: fn(usize, usize, usize) -> usize,
    ) -> Result<Self> {
        let (planes, in_h, in_w, out_shape) = self.resample_dims(op, out_h, out_w)?;
        let rows: Vec<usize> = (0..out_h).map(|y| index(y, in_h, out_h)).collect();
        let cols: Vec<usize> = (0..out_w).map(|x| index(x, in_w, out_w)).collect();
        let src = self.data();
        let mut data = Vec::with_capacity(planes * out_h * out_w);
        for p in 0..planes {
            let plane = &src[p * in_h * in_w..(p + 1) * in_h * in_w];
            for &y in &rows {
                let row = &plane[y * in_w..(y + 1) * in_w];
                data.extend(cols.iter().map(|&x| row[x]));
            }
        }
        Tensor::new(out_shape, data)
    }
}

impl<T: Element> Tensor<T> {
    /// Bicubic resampling of the last two dims, as torch `F.interpolate(x, size=(out_h,
    /// out_w), mode="bicubic", align_corners=..., antialias=False)` (Keys' kernel, a = -0.75,
    /// border indices clamped). Computed in f32 and converted back to `T`.
    pub fn interpolate_bicubic(
        &self,
        out_h: usize,
        out_w: usize,
        align_corners: bool,
    ) -> Result<Self> {
        let (planes, in_h, in_w, out_shape) =
            self.resample_dims("interpolate_bicubic", out_h, out_w)?;
        let ty = cubic_taps(in_h, out_h, align_corners);
        let tx = cubic_taps(in_w, out_w, align_corners);
        let src = self.data();
        let mut data = Vec::with_capacity(planes * out_h * out_w);
        for p in 0..planes {
            let plane = &src[p * in_h * in_w..(p + 1) * in_h * in_w];
            for yt in &ty {
                data.extend(tx.iter().map(|xt| {
                    let v: f32 = yt
                        .iter()
                        .map(|&(y, wy)| {
                            let row = &plane[y * in_w..(y + 1) * in_w];
                            wy * xt.iter().map(|&(x, wx)| row[x].to_f32() * wx).sum::<f32>()
                        })
                        .sum();
                    T::from_f32(v)
                }));
            }
        }
        Tensor::new(out_shape, data)
    }

    /// Antialiased resampling of the last two dims with `filter`: the filter is widened by the
    /// scale when shrinking and sources past the borders are dropped (weights renormalised).
    /// Columns are filtered first, then rows, each pass skipped when its size is unchanged, as
    /// torch `F.interpolate(..., antialias=True, align_corners=False)` (`Triangle`: bilinear,
    /// `Cubic`: bicubic) and PIL's resize do. Computed in f32.
    pub fn interpolate_filtered(
        &self,
        out_h: usize,
        out_w: usize,
        filter: ResampleFilter,
    ) -> Result<Self> {
        let (planes, in_h, in_w, out_shape) =
            self.resample_dims("interpolate_filtered", out_h, out_w)?;
        let mut cur: Vec<f32> = self.data().iter().map(|v| v.to_f32()).collect();
        let mut w = in_w;
        if out_w != in_w {
            cur = apply_taps(
                &cur,
                planes,
                in_h,
                in_w,
                &filter_taps(in_w, out_w, filter),
                true,
            );
            w = out_w;
        }
        if out_h != in_h {
            cur = apply_taps(
                &cur,
                planes,
                in_h,
                w,
                &filter_taps(in_h, out_h, filter),
                false,
            );
        }
        Tensor::new(out_shape, cur.into_iter().map(T::from_f32).collect())
    }

    /// Bilinear resampling of the last two dims to `out_h` x `out_w`, as torch
    /// `F.interpolate(x, size=(out_h, out_w), mode="bilinear", align_corners=...,
    /// antialias=False)`. Computed in f32 and converted back to `T`.
    pub fn interpolate_bilinear(
        &self,
        out_h: usize,
        out_w: usize,
        align_corners: bool,
    ) -> Result<Self> {
        let (planes, in_h, in_w, out_shape) =
            self.resample_dims("interpolate_bilinear", out_h, out_w)?;
        let ty = linear_taps(in_h, out_h, align_corners);
        let tx = linear_taps(in_w, out_w, align_corners);
        let src = self.data();
        let mut data = Vec::with_capacity(planes * out_h * out_w);
        for p in 0..planes {
            let plane = &src[p * in_h * in_w..(p + 1) * in_h * in_w];
            for &(y0, y1, wy0, wy1) in &ty {
                let r0 = &plane[y0 * in_w..(y0 + 1) * in_w];
                let r1 = &plane[y1 * in_w..(y1 + 1) * in_w];
                data.extend(tx.iter().map(|&(x0, x1, wx0, wx1)| {
                    let t0 = r0[x0].to_f32() * wx0 + r0[x1].to_f32() * wx1;
                    let t1 = r1[x0].to_f32() * wx0 + r1[x1].to_f32() * wx1;
                    T::from_f32(t0 * wy0 + t1 * wy1)
                }));
            }
        }
        Tensor::new(out_shape, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_doubles_and_halves() {
        let t = Tensor::new([1, 1, 2, 2], vec![1f32, 2., 3., 4.]).unwrap();
        let up = t.interpolate_nearest(4, 4).unwrap();
        assert_eq!(up.shape(), &[1, 1, 4, 4]);
        assert_eq!(&up.data()[..8], &[1., 1., 2., 2., 1., 1., 2., 2.]);
        let down = up.interpolate_nearest(2, 2).unwrap();
        assert_eq!(down, t);
        assert_eq!(t.interpolate_nearest(2, 2).unwrap(), t);
    }

    #[test]
    fn bilinear_align_corners_endpoints() {
        let t = Tensor::new([1, 3], vec![0f32, 1., 2.]).unwrap();
        let up = t.interpolate_bilinear(1, 5, true).unwrap();
        assert_eq!(up.data(), &[0., 0.5, 1., 1.5, 2.]);
        let h = Tensor::<half::f16>::from_f32(&t)
            .interpolate_bilinear(1, 5, true)
            .unwrap();
        assert_eq!(h.to_f32(), up);
    }

    #[test]
    fn rejects_bad_sizes() {
        let t = Tensor::<f32>::zeros([2, 2]).unwrap();
        assert!(t.interpolate_bilinear(0, 3, false).is_err());
        assert!(t.interpolate_nearest(3, 0).is_err());
        assert!(Tensor::<f32>::zeros([4])
            .unwrap()
            .interpolate_nearest(2, 2)
            .is_err());
        assert!(Tensor::<f32>::zeros([0, 2])
            .unwrap()
            .interpolate_nearest(2, 2)
            .is_err());
        let empty_batch = Tensor::<f32>::zeros([0, 3, 2, 2]).unwrap();
        assert_eq!(
            empty_batch
                .interpolate_bilinear(4, 4, false)
                .unwrap()
                .shape(),
            &[0, 3, 4, 4]
        );
    }
}
