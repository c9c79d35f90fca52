//! The discrete DDPM noise schedule of a model: `alphas_cumprod`, its sigmas and the
//! sigma <-> timestep conversion of k-diffusion's `DiscreteSchedule`.

use crate::sampling::SamplingError;

/// Number of training timesteps of the DDPM models sd-rs supports.
pub const TIMESTEPS: usize = 1000;

/// `beta_start` of the SD1/SD2/SDXL `scaled_linear` schedule.
pub const SCALED_LINEAR_BETA_START: f64 = 0.00085;
/// `beta_end` of the SD1/SD2/SDXL `scaled_linear` schedule.
pub const SCALED_LINEAR_BETA_END: f64 = 0.012;

/// A model's discrete noise schedule: `sigma_i = sqrt((1 - alphabar_i) / alphabar_i)` for each
/// training timestep `i`, ascending.
///
/// Values are kept in f64 (sd.cpp accumulates the cumulative product in f32; the difference is
/// below 5e-5 relative at `t = 999`).
#[derive(Clone, Debug, PartialEq)]
pub struct NoiseSchedule {
    alphas_cumprod: Vec<f64>,
    sigmas: Vec<f64>,
    log_sigmas: Vec<f64>,
}

impl NoiseSchedule {
    /// The `scaled_linear` schedule (`betas = linspace(sqrt(0.00085), sqrt(0.012), 1000)^2`) of
    /// SD1.x, SD2.x and SDXL.
    pub fn scaled_linear() -> Self {
        Self::scaled_linear_with(SCALED_LINEAR_BETA_START, SCALED_LINEAR_BETA_END, TIMESTEPS)
            .expect("the built-in schedule is valid")
    }

    /// A `scaled_linear` schedule with custom betas and `timesteps` entries.
    pub fn scaled_linear_with(
        beta_start: f64,
        beta_end: f64,
        timesteps: usize,
    ) -> Result<Self, SamplingError> {
        if timesteps < 2 {
            return Err(SamplingError::InvalidSchedule(format!(
                "{timesteps} timesteps (need at least 2)"
            )));
        }
        let (s0, s1) = (beta_start.sqrt(), beta_end.sqrt());
        let mut product = 1.0f64;
        let alphas = (0..timesteps)
            .map(|i| {
                let b = s0 + (s1 - s0) * i as f64 / (timesteps - 1) as f64;
                product *= 1.0 - b * b;
                product
            })
            .collect();
        Self::from_alphas_cumprod(alphas)
    }

    /// A schedule from a model's stored `alphas_cumprod` (each in `(0, 1]`, at least 2).
    pub fn from_alphas_cumprod(alphas_cumprod: Vec<f64>) -> Result<Self, SamplingError> {
        if alphas_cumprod.len() < 2 {
            return Err(SamplingError::InvalidSchedule(format!(
                "{} alphas_cumprod values (need at least 2)",
                alphas_cumprod.len()
            )));
        }
        if let Some(bad) = alphas_cumprod
            .iter()
            .find(|a| !(a.is_finite() && **a > 0.0 && **a < 1.0))
        {
            return Err(SamplingError::InvalidSchedule(format!(
                "alphas_cumprod value {bad} outside (0, 1)"
            )));
        }
        let sigmas: Vec<f64> = alphas_cumprod
            .iter()
            .map(|a| ((1.0 - a) / a).sqrt())
            .collect();
        let log_sigmas = sigmas.iter().map(|s| s.ln()).collect();
        Ok(NoiseSchedule {
            alphas_cumprod,
            sigmas,
            log_sigmas,
        })
    }

    /// Number of training timesteps.
    pub fn len(&self) -> usize {
        self.sigmas.len()
    }

    /// Always false (a schedule holds at least 2 timesteps).
    pub fn is_empty(&self) -> bool {
        self.sigmas.is_empty()
    }

    /// `alphas_cumprod`, one per timestep.
    pub fn alphas_cumprod(&self) -> &[f64] {
        &self.alphas_cumprod
    }

    /// Sigma of each training timestep, ascending.
    pub fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }

    /// Smallest sigma (timestep 0).
    pub fn sigma_min(&self) -> f32 {
        self.sigmas[0] as f32
    }

    /// Largest sigma (last timestep).
    pub fn sigma_max(&self) -> f32 {
        self.sigmas[self.sigmas.len() - 1] as f32
    }

    /// The highest timestep index, `len - 1`.
    pub fn t_max(&self) -> usize {
        self.sigmas.len() - 1
    }

    /// The fractional timestep of `sigma`: linear interpolation in log-sigma between the two
    /// neighbouring training sigmas, clamped to `[0, t_max]` (k-diffusion's `sigma_to_t`).
    pub fn sigma_to_t(&self, sigma: f32) -> f32 {
        let log_sigma = (sigma as f64).ln();
        let n = self.log_sigmas.len();
        let count = self.log_sigmas.iter().filter(|&&l| log_sigma >= l).count();
        let low = count.saturating_sub(1).min(n - 2);
        let (lo, hi) = (self.log_sigmas[low], self.log_sigmas[low + 1]);
        let w = ((lo - log_sigma) / (lo - hi)).clamp(0.0, 1.0);
        ((1.0 - w) * low as f64 + w * (low + 1) as f64) as f32
    }

    /// The sigma of fractional timestep `t` (clamped to `[0, t_max]`): log-linear interpolation
    /// of the training sigmas (k-diffusion's `t_to_sigma`).
    pub fn t_to_sigma(&self, t: f32) -> f32 {
        let t = (t as f64).clamp(0.0, self.t_max() as f64);
        let t = if t.is_nan() { 0.0 } else { t };
        let low = t.floor() as usize;
        let high = t.ceil() as usize;
        let w = t - low as f64;
        ((1.0 - w) * self.log_sigmas[low] + w * self.log_sigmas[high]).exp() as f32
    }

    /// The training timestep whose sigma is closest to `sigma` (used by TCD).
    pub fn nearest_timestep(&self, sigma: f32) -> usize {
        let s = sigma as f64;
        let idx = self.sigmas.partition_point(|&v| v < s);
        if idx == 0 {
            return 0;
        }
        if idx >= self.sigmas.len() {
            return self.sigmas.len() - 1;
        }
        if (self.sigmas[idx] - s).abs() < (self.sigmas[idx - 1] - s).abs() {
            idx
        } else {
            idx - 1
        }
    }
}

impl Default for NoiseSchedule {
    fn default() -> Self {
        Self::scaled_linear()
    }
}
