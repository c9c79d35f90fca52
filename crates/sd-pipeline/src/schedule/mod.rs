//! Sigma schedules: the `--scheduler` choices of stable-diffusion.cpp for discrete (DDPM) models.
//!
//! Every schedule returns `n + 1` descending sigmas for `n` steps, the last one 0.

mod ays;
mod flow;
mod noise;

use std::str::FromStr;

pub use ays::AysTable;
pub use flow::{flow_sigmas, flux_mu, flux_sigmas, sd3_sigmas, shifted_sigmas, ResolutionShift};
pub use noise::{NoiseSchedule, SCALED_LINEAR_BETA_END, SCALED_LINEAR_BETA_START, TIMESTEPS};

use crate::sampling::SamplingError;

/// A model's training noise schedule: what sigmas mean to it.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// A discrete DDPM schedule (SD1.x, SD2.x, SDXL): sigmas map to training timesteps.
    Ddpm(NoiseSchedule),
    /// Rectified flow (SD3, Flux, Qwen-Image): `sigma` in `[0, 1]` is the time itself,
    /// shifted by `shift` (`shift t / (1 + (shift - 1) t)`).
    Flow {
        /// The timestep shift (1: none); used without `resolution_shift`.
        shift: f32,
        /// A shift that grows with the image's token count (FLUX.1-dev, Qwen-Image:
        /// [`shifted_sigmas`]).
        resolution_shift: Option<ResolutionShift>,
        /// Where the unshifted sigmas lie: `linspace(1, 1/steps)` (FLUX), or evenly in time
        /// from 1 down to the smallest training sigma (SD3, [`sd3_sigmas`]).
        spacing: FlowSpacing,
    },
}

impl Schedule {
    /// SD1.x / SD2.x / SDXL's `scaled_linear` DDPM schedule.
    pub fn scaled_linear() -> Self {
        Schedule::Ddpm(NoiseSchedule::scaled_linear())
    }

    /// The DDPM schedule, if this is one.
    pub fn ddpm(&self) -> Option<&NoiseSchedule> {
        match self {
            Schedule::Ddpm(s) => Some(s),
            Schedule::Flow { .. } => None,
        }
    }
}

/// How a flow model's sigmas are spaced before the shift.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowSpacing {
    /// `linspace(1, 1/steps, steps)` (`FluxPipeline`).
    Linspace,
    /// Evenly spaced training times from the largest to the smallest shifted training sigma
    /// (`FlowMatchEulerDiscreteScheduler.set_timesteps` without explicit sigmas: SD3).
    TrainingRange,
}

/// A sigma scheduler (sd.cpp's `scheduler_t`, DDPM-model subset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// `discrete`: timesteps evenly spaced from `t_max` to 0 (k-diffusion `get_sigmas`).
    Discrete,
    /// `karras`: Karras et al. 2022 eq. 5 with `rho = 7` between the model's sigma range.
    Karras,
    /// `exponential`: sigmas evenly spaced in log-sigma.
    Exponential,
    /// `ays`: Align Your Steps noise levels for the given model family.
    Ays(AysTable),
    /// `sgm_uniform`: `n + 1` timesteps evenly spaced from `t_max` to 0, last dropped.
    SgmUniform,
    /// `simple`: every `len / n`-th training sigma from the top (ComfyUI's `simple`).
    Simple,
    /// `lcm`: the 50-step LCM training timesteps.
    Lcm,
}

impl Scheduler {
    /// The sd.cpp `--scheduler` name.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Discrete => "discrete",
            Scheduler::Karras => "karras",
            Scheduler::Exponential => "exponential",
            Scheduler::Ays(_) => "ays",
            Scheduler::SgmUniform => "sgm_uniform",
            Scheduler::Simple => "simple",
            Scheduler::Lcm => "lcm",
        }
    }

    /// Parse an sd.cpp scheduler name; `ays` needs the model's table.
    pub fn from_name(name: &str, ays: AysTable) -> Result<Self, SamplingError> {
        match name {
            "ays" => Ok(Scheduler::Ays(ays)),
            other => other.parse(),
        }
    }

    /// `n + 1` descending sigmas (last 0) for `n >= 1` steps of a model with `schedule`.
    pub fn sigmas(self, n: usize, schedule: &NoiseSchedule) -> Result<Vec<f32>, SamplingError> {
        if n == 0 {
            return Err(SamplingError::ZeroSteps);
        }
        let t_max = schedule.t_max() as f32;
        let (smin, smax) = (schedule.sigma_min() as f64, schedule.sigma_max() as f64);
        let frac = |i: usize| {
            if n == 1 {
                0.0
            } else {
                i as f64 / (n - 1) as f64
            }
        };
        let mut out: Vec<f32> = match self {
            Scheduler::Discrete => (0..n)
                .map(|i| {
                    let t = t_max as f64 * (1.0 - frac(i));
                    schedule.t_to_sigma(t as f32)
                })
                .collect(),
            Scheduler::Karras => {
                let rho = 7.0f64;
                let smin = smin.max(1e-6);
                let (lo, hi) = (smin.powf(1.0 / rho), smax.powf(1.0 / rho));
                (0..n)
                    .map(|i| (hi + frac(i) * (lo - hi)).powf(rho) as f32)
                    .collect()
            }
            Scheduler::Exponential => {
                let (lo, hi) = (smin.ln(), smax.ln());
                (0..n)
                    .map(|i| (hi + frac(i) * (lo - hi)).exp() as f32)
                    .collect()
            }
            Scheduler::Ays(table) => return Ok(ays::ays_sigmas(table, n)),
            Scheduler::SgmUniform => (0..n)
                .map(|i| {
                    let t = t_max as f64 * (1.0 - i as f64 / n as f64);
                    schedule.t_to_sigma(t as f32)
                })
                .collect(),
            Scheduler::Simple => {
                let len = schedule.len();
                let step = len as f64 / n as f64;
                (0..n)
                    .map(|i| {
                        let off = (i as f64 * step) as usize;
                        let idx = (len - 1).saturating_sub(off);
                        schedule.t_to_sigma(idx as f32)
                    })
                    .collect()
            }
            Scheduler::Lcm => {
                let original_steps = 50usize;
                let k = schedule.len() / original_steps;
                (0..n)
                    .map(|i| {
                        let index = (i * original_steps / n).min(original_steps);
                        let t = ((original_steps - index) * k).saturating_sub(1);
                        schedule.t_to_sigma(t as f32)
                    })
                    .collect()
            }
        };
        out.push(0.0);
        Ok(out)
    }
}

impl FromStr for Scheduler {
    type Err = SamplingError;

    /// Parse an sd.cpp scheduler name (`ays` selects the SD1.5 table; see
    /// [`Scheduler::from_name`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "discrete" => Scheduler::Discrete,
            "karras" => Scheduler::Karras,
            "exponential" => Scheduler::Exponential,
            "ays" => Scheduler::Ays(AysTable::Sd15),
            "sgm_uniform" => Scheduler::SgmUniform,
            "simple" => Scheduler::Simple,
            "lcm" => Scheduler::Lcm,
            _ => {
                return Err(SamplingError::UnknownName {
                    what: "scheduler",
                    name: s.to_string(),
                })
            }
        })
    }
}
