//! Rectified-flow sigma schedules. FLUX.1 as diffusers' `FluxPipeline` makes them: `steps`
//! sigmas `linspace(1, 1/steps)`, for dev shifted by an amount that grows with the image's
//! token count (`calculate_shift`: `mu` linear from 0.5 at 256 tokens to 1.15 at 4096,
//! then the exponential time shift `e^mu / (e^mu + 1/sigma - 1)`), for schnell unshifted;
//! a final 0 appended. The model reads `sigma` itself as its time.
//!
//! Qwen-Image as `QwenImagePipeline` makes them: FLUX.1-dev's recipe with the parameters of
//! `Qwen/Qwen-Image`'s `scheduler/config.json` (`mu` from 0.5 at 256 tokens to 0.9 at 8192)
//! and `shift_terminal` 0.02: the shifted sigmas are stretched so that the last non-zero
//! one is 0.02 (`1 - s` scaled by `(1 - 0.02) / (1 - s_last)`).
//!
//! SD3 as `StableDiffusion3Pipeline` makes them ([`sd3_sigmas`]): the scheduler's own
//! spacing, training times evenly spaced from `1000 * shift(1)` to `1000 * shift(1/1000)`,
//! divided by 1000 and shifted (again) by the constant `shift` (3). The last non-zero sigma
//! is then about 0.0089 at shift 3; stable-diffusion.cpp's discrete flow schedule ends at
//! `shift(0.001)` (0.003) instead. sd-rs follows diffusers.

use crate::sampling::SamplingError;

/// A shift that grows with the image's token count (diffusers' `use_dynamic_shifting` with
/// the exponential time shift): the parameters of a model's scheduler config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolutionShift {
    /// `base_image_seq_len`.
    pub base_seq_len: f64,
    /// `max_image_seq_len`.
    pub max_seq_len: f64,
    /// `base_shift`: `mu` at `base_seq_len` tokens.
    pub base_shift: f64,
    /// `max_shift`: `mu` at `max_seq_len` tokens.
    pub max_shift: f64,
    /// `shift_terminal`: the last non-zero sigma the shifted ones are stretched to.
    pub shift_terminal: Option<f64>,
}

impl ResolutionShift {
    /// `black-forest-labs/FLUX.1-dev`'s `scheduler/config.json`.
    pub const FLUX: ResolutionShift = ResolutionShift {
        base_seq_len: 256.0,
        max_seq_len: 4096.0,
        base_shift: 0.5,
        max_shift: 1.15,
        shift_terminal: None,
    };

    /// `Qwen/Qwen-Image`'s `scheduler/config.json`.
    pub const QWEN_IMAGE: ResolutionShift = ResolutionShift {
        base_seq_len: 256.0,
        max_seq_len: 8192.0,
        base_shift: 0.5,
        max_shift: 0.9,
        shift_terminal: Some(0.02),
    };

    /// `mu` for an image of `image_tokens` packed tokens (`(H/16) (W/16)`; diffusers'
    /// `calculate_shift`).
    pub fn mu(&self, image_tokens: usize) -> f64 {
        let m = (self.max_shift - self.base_shift) / (self.max_seq_len - self.base_seq_len);
        let b = self.base_shift - m * self.base_seq_len;
        image_tokens as f64 * m + b
    }
}

/// FLUX.1-dev's `mu` for an image of `image_tokens` packed tokens (`(H/16) (W/16)`).
pub fn flux_mu(image_tokens: usize) -> f64 {
    ResolutionShift::FLUX.mu(image_tokens)
}

/// The `steps + 1` sigmas of a FLUX.1 run: shifted for `image_tokens` (dev), or unshifted
/// (`None`: schnell).
pub fn flux_sigmas(steps: usize, image_tokens: Option<usize>) -> Result<Vec<f32>, SamplingError> {
    shifted_sigmas(steps, image_tokens.map(|t| (t, ResolutionShift::FLUX)))
}

/// The `steps + 1` sigmas `linspace(1, 1/steps)`, shifted for `(image_tokens, shift)` when
/// given, a final 0 appended.
pub fn shifted_sigmas(
    steps: usize,
    shift: Option<(usize, ResolutionShift)>,
) -> Result<Vec<f32>, SamplingError> {
    if steps == 0 {
        return Err(SamplingError::InvalidSigmas("0 steps".into()));
    }
    let mu = shift.map(|(tokens, r)| r.mu(tokens));
    let mut out: Vec<f64> = (0..steps)
        .map(|i| {
            // np.linspace(1, 1/steps, steps)
            let s = if steps == 1 {
                1.0
            } else {
                1.0 + (1.0 / steps as f64 - 1.0) * i as f64 / (steps - 1) as f64
            };
            match mu {
                Some(mu) => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
                None => s,
            }
        })
        .collect();
    if let Some(terminal) = shift.and_then(|(_, r)| r.shift_terminal) {
        // `stretch_shift_to_terminal`.
        let last = 1.0 - out[steps - 1];
        let scale = last / (1.0 - terminal);
        if scale > 0.0 {
            for s in &mut out {
                *s = 1.0 - (1.0 - *s) / scale;
            }
        }
    }
    let mut out: Vec<f32> = out.into_iter().map(|s| s as f32).collect();
    out.push(0.0);
    Ok(out)
}

/// `shift s / (1 + (shift - 1) s)`.
fn time_shift(shift: f64, s: f64) -> f64 {
    shift * s / (1.0 + (shift - 1.0) * s)
}

/// The `steps + 1` sigmas of an SD3 run with constant `shift` (see the module
/// documentation).
pub fn sd3_sigmas(steps: usize, shift: f32) -> Result<Vec<f32>, SamplingError> {
    if steps == 0 {
        return Err(SamplingError::InvalidSigmas("0 steps".into()));
    }
    let shift = shift as f64;
    // The scheduler's training sigmas are shifted at construction: its range is
    // [shift(1/1000), shift(1)] = [shift(1/1000), 1].
    let (hi, lo) = (
        1000.0 * time_shift(shift, 1.0),
        1000.0 * time_shift(shift, 1e-3),
    );
    let mut out: Vec<f32> = (0..steps)
        .map(|i| {
            let t = if steps == 1 {
                hi
            } else {
                hi + (lo - hi) * i as f64 / (steps - 1) as f64
            };
            time_shift(shift, t / 1000.0) as f32
        })
        .collect();
    out.push(0.0);
    Ok(out)
}

/// The `steps + 1` sigmas of a flow model: a resolution shift for `(image_tokens, shift)`
/// when given, else the `spacing`'s sigmas shifted by a constant `shift` (`shift s / (1 +
/// (shift - 1) s)`; 1: none), a final 0 appended.
pub fn flow_sigmas(
    steps: usize,
    shift: f32,
    resolution: Option<(usize, ResolutionShift)>,
    spacing: super::FlowSpacing,
) -> Result<Vec<f32>, SamplingError> {
    if spacing == super::FlowSpacing::TrainingRange && resolution.is_none() {
        return sd3_sigmas(steps, shift);
    }
    let mut out = shifted_sigmas(steps, resolution)?;
    if resolution.is_none() && shift != 1.0 {
        for s in &mut out {
            *s = shift * *s / (1.0 + (shift - 1.0) * *s);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against `FluxPipeline`'s scheduler (`make_flux_fixtures.py` writes the reference).
    #[test]
    fn flux_sigmas_equal_diffusers() {
        let text = include_str!("../../tests/fixtures/sampling/flux_sigmas.json");
        let refs: std::collections::BTreeMap<String, Vec<f64>> =
            serde_json::from_str(text).unwrap();
        assert_eq!(refs.len(), 12);
        for (key, want) in refs {
            let parts: Vec<&str> = key.split('_').collect();
            let steps: usize = parts[1].parse().unwrap();
            let tokens: usize = parts[2].parse().unwrap();
            let got = flux_sigmas(steps, (parts[0] == "dev").then_some(tokens)).unwrap();
            assert_eq!(got.len(), want.len(), "{key}");
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 2e-6, "{key}: {got:?} vs {want:?}");
            }
        }
    }

    /// `FlowMatchEulerDiscreteScheduler` with `Qwen/Qwen-Image`'s scheduler config, as
    /// `QwenImagePipeline` calls it (sigmas `linspace(1, 1/steps)`, `mu` from the packed
    /// token count; diffusers 0.42).
    #[test]
    fn qwen_image_sigmas_equal_diffusers() {
        let cases: [(usize, usize, &[f64]); 3] = [
            (4, 16, &[1.0, 0.7431313, 0.4248133, 0.02, 0.0]),
            (
                8,
                1024,
                &[
                    1.0, 0.9061342, 0.8013588, 0.6836543, 0.5504702, 0.3985381, 0.2235991, 0.02,
                    0.0,
                ],
            ),
            (
                20,
                4096,
                &[
                    1.0, 0.9722365, 0.9430112, 0.9122055, 0.8796875, 0.8453104, 0.8089104,
                    0.770303, 0.7292817, 0.6856123, 0.6390301, 0.5892336, 0.5358782, 0.478568,
                    0.4168468, 0.3501847, 0.2779637, 0.1994582, 0.1138107, 0.02, 0.0,
                ],
            ),
        ];
        for (steps, tokens, want) in cases {
            let got = shifted_sigmas(steps, Some((tokens, ResolutionShift::QWEN_IMAGE))).unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!((*g as f64 - w).abs() < 2e-6, "{steps} {tokens}: {got:?}");
            }
        }
    }

    #[test]
    fn zero_steps_is_an_error() {
        assert!(flux_sigmas(0, None).is_err());
        assert!(sd3_sigmas(0, 3.0).is_err());
    }

    /// `FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(4)` (diffusers 0.42):
    /// sigmas [1.0000, 0.8577, 0.6022, 0.0089, 0].
    #[test]
    fn sd3_sigmas_equal_the_scheduler() {
        let got = sd3_sigmas(4, 3.0).unwrap();
        let want = [1.0, 0.857_692_3, 0.602_150_6, 0.008_928_6, 0.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
        assert_eq!(sd3_sigmas(1, 3.0).unwrap(), [1.0, 0.0]);
    }
}
