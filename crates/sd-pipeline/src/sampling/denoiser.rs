//! Denoiser parameterisations: turn a model's eps or v prediction into the denoised estimate
//! `D(x; sigma)` the samplers integrate (k-diffusion's `CompVisDenoiser` / `CompVisVDenoiser`).

use sd_tensor::Tensor;

use super::SamplingError;
use crate::schedule::NoiseSchedule;

/// What the model predicts.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Prediction {
    /// The added noise `eps` (SD1.x, SD2.x base, SDXL).
    #[default]
    Eps,
    /// The velocity `v = alpha * eps - sigma_vp * x0` (SD2.x 768-v).
    V,
    /// Rectified flow: `x_t = (1 - t) x0 + t eps` with `t = sigma`, the model predicting
    /// `eps - x0` (SD3, Flux, Qwen-Image); the network reads `sigma * time_scale` as its
    /// time.
    Flow {
        /// What the network's time is in units of sigma: 1000 for SD3 (diffusers' pipeline
        /// passes `sigma * num_train_timesteps`), 1 for FLUX.1 (it scales by 1000 inside).
        time_scale: f32,
    },
}

/// The k-diffusion preconditioning of one sigma: `D(x) = c_skip * x + c_out * F(c_in * x, t)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scalings {
    /// Weight of the input in the denoised estimate.
    pub c_skip: f32,
    /// Weight of the model output in the denoised estimate.
    pub c_out: f32,
    /// Scale applied to the input before the model sees it.
    pub c_in: f32,
}

impl Prediction {
    /// The scalings at `sigma` (`sigma_data = 1`).
    ///
    /// Eps: `c_skip = 1`, `c_out = -sigma`, `c_in = 1 / sqrt(sigma^2 + 1)`.
    /// V: `c_skip = 1 / (sigma^2 + 1)`, `c_out = -sigma / sqrt(sigma^2 + 1)`, same `c_in`.
    /// Flow: `c_skip = 1`, `c_out = -sigma`, `c_in = 1` (the input is not rescaled).
    pub fn scalings(self, sigma: f32) -> Scalings {
        let norm = (sigma * sigma + 1.0).sqrt();
        let c_in = 1.0 / norm;
        match self {
            Prediction::Eps => Scalings {
                c_skip: 1.0,
                c_out: -sigma,
                c_in,
            },
            Prediction::V => Scalings {
                c_skip: 1.0 / (sigma * sigma + 1.0),
                c_out: -sigma / norm,
                c_in,
            },
            Prediction::Flow { .. } => Scalings {
                c_skip: 1.0,
                c_out: -sigma,
                c_in: 1.0,
            },
        }
    }
}

/// A diffusion model seen by the sampler: given the preconditioned input it returns the raw
/// prediction (eps or v, per [`Prediction`]). The pipeline implements it over the UNet with
/// classifier-free guidance.
pub trait Denoise {
    /// The model output for `x_in = c_in * x` at noise level `sigma`, i.e. fractional training
    /// timestep `timestep` (from [`NoiseSchedule::sigma_to_t`]). Same shape as `x_in`.
    fn predict(
        &mut self,
        x_in: &Tensor<f32>,
        sigma: f32,
        timestep: f32,
    ) -> Result<Tensor<f32>, SamplingError>;
}

/// Something that returns the denoised estimate `D(x; sigma)`: what every sampler calls.
///
/// Closures `FnMut(&Tensor<f32>, f32) -> Result<Tensor<f32>, SamplingError>` implement it.
pub trait Denoised {
    /// The denoised estimate of `x` at noise level `sigma` (same shape as `x`).
    fn denoised(&mut self, x: &Tensor<f32>, sigma: f32) -> Result<Tensor<f32>, SamplingError>;

    /// Whether the model is a rectified flow (`x = (1 - s) x0 + s noise`): ancestral
    /// samplers re-noise differently.
    fn flow(&self) -> bool {
        false
    }
}

impl<F> Denoised for F
where
    F: FnMut(&Tensor<f32>, f32) -> Result<Tensor<f32>, SamplingError>,
{
    fn denoised(&mut self, x: &Tensor<f32>, sigma: f32) -> Result<Tensor<f32>, SamplingError> {
        self(x, sigma)
    }
}

/// A [`Denoise`] model behind the k-diffusion preconditioning of a discrete schedule.
#[derive(Debug)]
pub struct KDenoiser<'s, M> {
    /// The wrapped model.
    pub model: M,
    /// What the model predicts.
    pub prediction: Prediction,
    /// The model's training noise schedule (for sigma -> timestep).
    pub schedule: &'s NoiseSchedule,
}

impl<'s, M: Denoise> KDenoiser<'s, M> {
    /// Wrap `model`.
    pub fn new(model: M, prediction: Prediction, schedule: &'s NoiseSchedule) -> Self {
        KDenoiser {
            model,
            prediction,
            schedule,
        }
    }
}

impl<M: Denoise> Denoised for KDenoiser<'_, M> {
    fn flow(&self) -> bool {
        matches!(self.prediction, Prediction::Flow { .. })
    }

    fn denoised(&mut self, x: &Tensor<f32>, sigma: f32) -> Result<Tensor<f32>, SamplingError> {
        let s = self.prediction.scalings(sigma);
        // A flow model's time is sigma (in its units).
        let t = match self.prediction {
            Prediction::Flow { time_scale } => sigma * time_scale,
            _ => self.schedule.sigma_to_t(sigma),
        };
        let x_in = x.scale(s.c_in);
        let out = self.model.predict(&x_in, sigma, t)?;
        if out.shape() != x.shape() {
            return Err(SamplingError::ModelShape {
                expected: x.shape().to_vec(),
                got: out.shape().to_vec(),
            });
        }
        Ok(x.axpby(s.c_skip, &out, s.c_out)?)
    }
}
