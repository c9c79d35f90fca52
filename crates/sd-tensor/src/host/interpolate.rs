//! Resampling over the last two dims, matching torch `F.interpolate` (mode `nearest` and
//! `bilinear`, `antialias=False`, output size given) on the CPU.
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
        let (planes, in_h, in_w, out_shape) =
            self.resample_dims("interpolate_nearest", out_h, out_w)?;
        let rows: Vec<usize> = (0..out_h).map(|y| nearest_index(y, in_h, out_h)).collect();
        let cols: Vec<usize> = (0..out_w).map(|x| nearest_index(x, in_w, out_w)).collect();
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
