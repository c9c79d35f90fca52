//! Samplers of stable-diffusion.cpp (`--sampling-method`) for discrete (eps / v) models, the
//! denoiser parameterisations (flow prediction included) they integrate, and their errors.
//!
//! A sampler integrates the probability-flow ODE (or its ancestral SDE variants)
//! `dx/dsigma = (x - D(x; sigma)) / sigma` over a descending sigma list from
//! [`crate::schedule::Scheduler::sigmas`], starting from `x = noise * sigmas[0]` (txt2img).

mod denoiser;
mod methods;

use std::str::FromStr;

use sd_tensor::host::ShapeError;
use sd_tensor::Tensor;
use thiserror::Error;

pub use denoiser::{Denoise, Denoised, KDenoiser, Prediction, Scalings};

use crate::rng::Rng;
use crate::schedule::{NoiseSchedule, Scheduler};

/// Errors of schedules, samplers and RNG helpers.
#[derive(Debug, Error)]
pub enum SamplingError {
    /// A schedule or sampler was asked for zero steps.
    #[error("zero sampling steps requested")]
    ZeroSteps,
    /// The sigma list cannot be sampled.
    #[error("invalid sigmas: {0}")]
    InvalidSigmas(String),
    /// The model's noise schedule is invalid.
    #[error("invalid noise schedule: {0}")]
    InvalidSchedule(String),
    /// An unknown sampler, scheduler or RNG name.
    #[error("unknown {what} name {name:?}")]
    UnknownName {
        /// What was being parsed (`sampler`, `scheduler`, `rng`).
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The model returned a tensor of the wrong shape.
    #[error("model output shape {got:?} differs from the input shape {expected:?}")]
    ModelShape {
        /// The input shape.
        expected: Vec<usize>,
        /// The returned shape.
        got: Vec<usize>,
    },
    /// A tensor shape error.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The model failed.
    #[error("model evaluation failed: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The model returned NaN or infinite values.
    #[error(
        "the {model} returned {count} NaN or infinite values at sigma {sigma} \
         (corrupt weights, or a --cfg-scale too large)"
    )]
    NonFinite {
        /// The model (`diffusion network`).
        model: &'static str,
        /// The noise level of the evaluation.
        sigma: f32,
        /// How many values are not finite.
        count: usize,
    },
}

/// A sampling method, named as stable-diffusion.cpp's `--sampling-method`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SampleMethod {
    /// `euler`: first-order ODE step.
    Euler,
    /// `euler_a`: Euler ancestral (noise re-injection scaled by eta).
    EulerA,
    /// `heun`: second-order Heun (two model calls per step).
    Heun,
    /// `dpm2`: DPM-Solver-2 (midpoint in log-sigma).
    Dpm2,
    /// `dpm++2s_a`: DPM-Solver++(2S) ancestral.
    Dpmpp2sA,
    /// `dpm++2m`: DPM-Solver++(2M).
    Dpmpp2m,
    /// `dpm++2mv2`: sd.cpp's variant of DPM-Solver++(2M) with a symmetric step ratio.
    Dpmpp2mV2,
    /// `ipndm`: improved pseudo-numerical (Adams-Bashforth up to order 4).
    Ipndm,
    /// `ipndm_v`: iPNDM with variable step sizes.
    IpndmV,
    /// `lcm`: latent consistency sampling (denoise, then re-noise to the next sigma).
    Lcm,
    /// `ddim_trailing`: DDIM with trailing timesteps (Euler ancestral; sd.cpp pairs it with the
    /// `simple` scheduler and eta 0).
    DdimTrailing,
    /// `tcd`: trajectory consistency distillation sampling (gamma = eta).
    Tcd,
}

impl SampleMethod {
    /// Every method, in sd.cpp's order.
    pub const ALL: [SampleMethod; 12] = [
        SampleMethod::Euler,
        SampleMethod::EulerA,
        SampleMethod::Heun,
        SampleMethod::Dpm2,
        SampleMethod::Dpmpp2sA,
        SampleMethod::Dpmpp2m,
        SampleMethod::Dpmpp2mV2,
        SampleMethod::Ipndm,
        SampleMethod::IpndmV,
        SampleMethod::Lcm,
        SampleMethod::DdimTrailing,
        SampleMethod::Tcd,
    ];

    /// The sd.cpp name.
    pub fn name(self) -> &'static str {
        match self {
            SampleMethod::Euler => "euler",
            SampleMethod::EulerA => "euler_a",
            SampleMethod::Heun => "heun",
            SampleMethod::Dpm2 => "dpm2",
            SampleMethod::Dpmpp2sA => "dpm++2s_a",
            SampleMethod::Dpmpp2m => "dpm++2m",
            SampleMethod::Dpmpp2mV2 => "dpm++2mv2",
            SampleMethod::Ipndm => "ipndm",
            SampleMethod::IpndmV => "ipndm_v",
            SampleMethod::Lcm => "lcm",
            SampleMethod::DdimTrailing => "ddim_trailing",
            SampleMethod::Tcd => "tcd",
        }
    }

    /// sd.cpp's eta when none is given: 1 for the ancestral methods, 0 otherwise.
    pub fn default_eta(self) -> f32 {
        match self {
            SampleMethod::EulerA | SampleMethod::Dpmpp2sA => 1.0,
            _ => 0.0,
        }
    }

    /// sd.cpp's scheduler when none is given: `lcm` for lcm/tcd, `simple` for ddim_trailing,
    /// `discrete` otherwise.
    pub fn default_scheduler(self) -> Scheduler {
        match self {
            SampleMethod::Lcm | SampleMethod::Tcd => Scheduler::Lcm,
            SampleMethod::DdimTrailing => Scheduler::Simple,
            _ => Scheduler::Discrete,
        }
    }

    /// Whether the method draws noise from the RNG (for the given eta).
    pub fn is_stochastic(self, eta: f32) -> bool {
        match self {
            SampleMethod::Lcm => true,
            SampleMethod::EulerA
            | SampleMethod::Dpmpp2sA
            | SampleMethod::DdimTrailing
            | SampleMethod::Tcd => eta > 0.0,
            _ => false,
        }
    }
}

impl FromStr for SampleMethod {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SampleMethod::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| SamplingError::UnknownName {
                what: "sampler",
                name: s.to_string(),
            })
    }
}

/// [`sample_with_progress`] without a progress callback.
pub fn sample(
    method: SampleMethod,
    model: &mut dyn Denoised,
    x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: Option<f32>,
    schedule: &NoiseSchedule,
) -> Result<Tensor<f32>, SamplingError> {
    sample_with_progress(method, model, x, sigmas, rng, eta, schedule, &mut |_, _| {})
}

/// Run `method` from `x` (already scaled to `sigmas[0]`) down the `sigmas` list, calling
/// `on_step(step, total)` before each step (`step` 1-based, `total = sigmas.len() - 1`).
///
/// `eta` of `None` uses [`SampleMethod::default_eta`]. `schedule` is the model's training
/// schedule (TCD reads its `alphas_cumprod`). Noise comes from `rng`, one
/// [`Rng::randn`] call per injection, as sd.cpp draws it.
///
/// Errors: fewer than 2 sigmas ([`SamplingError::ZeroSteps`]), non-finite, negative or
/// increasing sigmas, a zero sigma before the last one, or a non-finite eta
/// ([`SamplingError::InvalidSigmas`]), and any model or shape error.
#[allow(clippy::too_many_arguments)]
pub fn sample_with_progress(
    method: SampleMethod,
    model: &mut dyn Denoised,
    x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: Option<f32>,
    schedule: &NoiseSchedule,
    on_step: &mut dyn FnMut(usize, usize),
) -> Result<Tensor<f32>, SamplingError> {
    validate_sigmas(sigmas)?;
    let eta = eta.unwrap_or_else(|| method.default_eta());
    if !eta.is_finite() || eta < 0.0 {
        return Err(SamplingError::InvalidSigmas(format!(
            "eta {eta} must be finite and >= 0"
        )));
    }
    use methods as m;
    match method {
        SampleMethod::Euler => m::euler(model, on_step, x, sigmas),
        SampleMethod::EulerA | SampleMethod::DdimTrailing => {
            m::euler_ancestral(model, on_step, x, sigmas, rng, eta)
        }
        SampleMethod::Heun => m::heun(model, on_step, x, sigmas),
        SampleMethod::Dpm2 => m::dpm2(model, on_step, x, sigmas),
        SampleMethod::Dpmpp2sA => m::dpmpp_2s_ancestral(model, on_step, x, sigmas, rng, eta),
        SampleMethod::Dpmpp2m => m::dpmpp_2m(model, on_step, x, sigmas, false),
        SampleMethod::Dpmpp2mV2 => m::dpmpp_2m(model, on_step, x, sigmas, true),
        SampleMethod::Ipndm => m::ipndm(model, on_step, x, sigmas, false),
        SampleMethod::IpndmV => m::ipndm(model, on_step, x, sigmas, true),
        SampleMethod::Lcm => m::lcm(model, on_step, x, sigmas, rng),
        SampleMethod::Tcd => m::tcd(model, on_step, x, sigmas, rng, eta, schedule),
    }
}

fn validate_sigmas(sigmas: &[f32]) -> Result<(), SamplingError> {
    if sigmas.len() < 2 {
        return Err(SamplingError::ZeroSteps);
    }
    let last = sigmas.len() - 1;
    for (i, &s) in sigmas.iter().enumerate() {
        if !s.is_finite() || s < 0.0 {
            return Err(SamplingError::InvalidSigmas(format!(
                "sigma[{i}] = {s} is not a finite non-negative number"
            )));
        }
        if i < last && s <= 0.0 {
            return Err(SamplingError::InvalidSigmas(format!(
                "sigma[{i}] = 0 before the last step"
            )));
        }
        if i > 0 && s > sigmas[i - 1] {
            return Err(SamplingError::InvalidSigmas(format!(
                "sigmas increase at index {i} ({} -> {s})",
                sigmas[i - 1]
            )));
        }
    }
    Ok(())
}
