//! f32 arithmetic and reductions on host tensors.
//!
//! Binary operations broadcast dims of size 1 (numpy rules) and return a [`ShapeError`] for
//! shapes that do not broadcast. Reductions accumulate in f64.

use super::shape::ShapeError;
use super::tensor::{Result, Tensor};

impl Tensor<f32> {
    fn binary(
        &self,
        op: &'static str,
        other: &Tensor<f32>,
        f: impl FnMut(f32, f32) -> f32,
    ) -> Result<Self> {
        self.zip_map(other, f).map_err(|e| match e {
            ShapeError::Mismatch { lhs, rhs, .. } => ShapeError::Mismatch { op, lhs, rhs },
            e => e,
        })
    }

    /// `self + other`, broadcasting.
    pub fn add(&self, other: &Tensor<f32>) -> Result<Self> {
        self.binary("add", other, |a, b| a + b)
    }

    /// `self - other`, broadcasting.
    pub fn sub(&self, other: &Tensor<f32>) -> Result<Self> {
        self.binary("sub", other, |a, b| a - b)
    }

    /// `self * other` elementwise, broadcasting.
    pub fn mul(&self, other: &Tensor<f32>) -> Result<Self> {
        self.binary("mul", other, |a, b| a * b)
    }

    /// `self / other` elementwise, broadcasting.
    pub fn div(&self, other: &Tensor<f32>) -> Result<Self> {
        self.binary("div", other, |a, b| a / b)
    }

    /// `self + s`.
    pub fn add_scalar(&self, s: f32) -> Self {
        self.map(|&v| v + s)
    }

    /// `self - s`.
    pub fn sub_scalar(&self, s: f32) -> Self {
        self.map(|&v| v - s)
    }

    /// `self * s`.
    pub fn mul_scalar(&self, s: f32) -> Self {
        self.map(|&v| v * s)
    }

    /// `self / s`.
    pub fn div_scalar(&self, s: f32) -> Self {
        self.map(|&v| v / s)
    }

    /// `self * s` (alias of [`Tensor::mul_scalar`]).
    pub fn scale(&self, s: f32) -> Self {
        self.mul_scalar(s)
    }

    /// `self * a + other * b`, broadcasting (a fused form of the sampler's update steps).
    pub fn axpby(&self, a: f32, other: &Tensor<f32>, b: f32) -> Result<Self> {
        self.binary("axpby", other, |x, y| x * a + y * b)
    }

    /// Elements clamped to `[min, max]` (NaN stays NaN).
    pub fn clamp(&self, min: f32, max: f32) -> Self {
        self.map(|&v| {
            if v < min {
                min
            } else if v > max {
                max
            } else {
                v
            }
        })
    }

    /// Sum of all elements (0 for an empty tensor).
    pub fn sum(&self) -> f32 {
        self.data().iter().map(|&v| v as f64).sum::<f64>() as f32
    }

    /// Mean of all elements (NaN for an empty tensor, as torch).
    pub fn mean(&self) -> f32 {
        (self.data().iter().map(|&v| v as f64).sum::<f64>() / self.numel() as f64) as f32
    }

    /// Population variance of all elements (NaN for an empty tensor).
    pub fn variance(&self) -> f32 {
        let n = self.numel() as f64;
        let mean = self.data().iter().map(|&v| v as f64).sum::<f64>() / n;
        (self
            .data()
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / n) as f32
    }

    /// Largest absolute value (0 for an empty tensor; NaN if any element is NaN).
    pub fn abs_max(&self) -> f32 {
        self.data().iter().fold(0f32, |m, &v| {
            if v.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        })
    }

    /// Smallest element (`None` for an empty tensor).
    pub fn min(&self) -> Option<f32> {
        self.data().iter().copied().reduce(f32::min)
    }

    /// Largest element (`None` for an empty tensor).
    pub fn max(&self) -> Option<f32> {
        self.data().iter().copied().reduce(f32::max)
    }

    /// Whether every element is finite.
    pub fn all_finite(&self) -> bool {
        self.data().iter().all(|v| v.is_finite())
    }

    fn same_shape(&self, op: &'static str, other: &Tensor<f32>) -> Result<()> {
        if self.shape() != other.shape() {
            return Err(ShapeError::Mismatch {
                op,
                lhs: self.shape().to_vec(),
                rhs: other.shape().to_vec(),
            });
        }
        Ok(())
    }

    /// Largest `|self - other|` over elements of two tensors of the same shape (NaN if either
    /// holds NaN at some position).
    pub fn max_abs_diff(&self, other: &Tensor<f32>) -> Result<f32> {
        self.same_shape("max_abs_diff", other)?;
        Ok(self
            .data()
            .iter()
            .zip(other.data())
            .fold(0f32, |m, (&a, &b)| {
                let d = (a - b).abs();
                if d.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            }))
    }

    /// Relative L2 error `||self - other|| / ||other||` for tensors of the same shape
    /// (`other` is the reference). 0 when both are all zero, infinite when only `other` is.
    pub fn rel_l2(&self, other: &Tensor<f32>) -> Result<f32> {
        self.same_shape("rel_l2", other)?;
        let (mut num, mut den) = (0f64, 0f64);
        for (&a, &b) in self.data().iter().zip(other.data()) {
            num += (a as f64 - b as f64).powi(2);
            den += (b as f64).powi(2);
        }
        Ok(if den == 0.0 {
            if num == 0.0 {
                0.0
            } else {
                f32::INFINITY
            }
        } else {
            (num / den).sqrt() as f32
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], v: &[f32]) -> Tensor<f32> {
        Tensor::new(shape, v.to_vec()).unwrap()
    }

    #[test]
    fn arithmetic_broadcasts() {
        let a = t(&[2, 2], &[1., 2., 3., 4.]);
        let row = t(&[2], &[10., 20.]);
        assert_eq!(a.add(&row).unwrap().data(), &[11., 22., 13., 24.]);
        assert_eq!(a.sub(&a).unwrap().data(), &[0.; 4]);
        assert_eq!(
            a.mul(&t(&[2, 1], &[2., 3.])).unwrap().data(),
            &[2., 4., 9., 12.]
        );
        assert_eq!(
            a.div(&Tensor::scalar(2.0)).unwrap().data(),
            &[0.5, 1., 1.5, 2.]
        );
        let e = a.add(&t(&[3], &[0.; 3])).unwrap_err();
        assert_eq!(
            e,
            ShapeError::Mismatch {
                op: "add",
                lhs: vec![2, 2],
                rhs: vec![3]
            }
        );
        assert_eq!(a.scale(2.0).add_scalar(1.0).data(), &[3., 5., 7., 9.]);
        assert_eq!(
            a.axpby(2.0, &row, 0.5).unwrap().data(),
            &[7., 14., 11., 18.]
        );
    }

    #[test]
    fn reductions() {
        let a = t(&[4], &[1., -5., 3., 1.]);
        assert_eq!(a.sum(), 0.0);
        assert_eq!(a.mean(), 0.0);
        assert_eq!(a.variance(), 9.0);
        assert_eq!(a.abs_max(), 5.0);
        assert_eq!((a.min(), a.max()), (Some(-5.0), Some(3.0)));
        assert_eq!(a.clamp(0.0, 2.0).data(), &[1., 0., 2., 1.]);
        let empty = Tensor::<f32>::zeros([0]).unwrap();
        assert!(empty.mean().is_nan());
        assert_eq!(
            (empty.sum(), empty.abs_max(), empty.max()),
            (0.0, 0.0, None)
        );
        assert!(t(&[2], &[1.0, f32::NAN]).abs_max().is_nan());
    }

    #[test]
    fn comparisons() {
        let a = t(&[2], &[3., 4.]);
        let b = t(&[2], &[3., 5.]);
        assert_eq!(a.max_abs_diff(&b).unwrap(), 1.0);
        let z = t(&[2], &[0., 0.]);
        assert_eq!(z.rel_l2(&z).unwrap(), 0.0);
        assert_eq!(a.rel_l2(&z).unwrap(), f32::INFINITY);
        assert!((z.rel_l2(&a).unwrap() - 1.0).abs() < 1e-7);
        assert!(a.max_abs_diff(&t(&[1, 2], &[3., 4.])).is_err());
        assert!(a.max_abs_diff(&t(&[2], &[3., f32::NAN])).unwrap().is_nan());
    }
}
