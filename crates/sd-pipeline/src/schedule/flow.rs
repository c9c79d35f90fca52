//! Rectified-flow sigma schedules. FLUX.1 as diffusers' `FluxPipeline` makes them: `steps`
//! sigmas `linspace(1, 1/steps)`, for dev shifted by an amount that grows with the image's
//! token count (`calculate_shift`: `mu` linear from 0.5 at 256 tokens to 1.15 at 4096,
//! then the exponential time shift `e^mu / (e^mu + 1/sigma - 1)`), for schnell unshifted;
//! a final 0 appended. The model reads `sigma` itself as its time.

use crate::sampling::SamplingError;

/// `base_image_seq_len` of FLUX.1-dev's scheduler config.
pub const FLUX_BASE_SEQ_LEN: f64 = 256.0;
/// `max_image_seq_len`.
pub const FLUX_MAX_SEQ_LEN: f64 = 4096.0;
/// `base_shift`.
pub const FLUX_BASE_SHIFT: f64 = 0.5;
/// `max_shift`.
pub const FLUX_MAX_SHIFT: f64 = 1.15;

/// FLUX.1-dev's `mu` for an image of `image_tokens` packed tokens (`(H/16) (W/16)`).
pub fn flux_mu(image_tokens: usize) -> f64 {
    let m = (FLUX_MAX_SHIFT - FLUX_BASE_SHIFT) / (FLUX_MAX_SEQ_LEN - FLUX_BASE_SEQ_LEN);
    let b = FLUX_BASE_SHIFT - m * FLUX_BASE_SEQ_LEN;
    image_tokens as f64 * m + b
}

/// The `steps + 1` sigmas of a FLUX.1 run: shifted for `image_tokens` (dev), or unshifted
/// (`None`: schnell).
pub fn flux_sigmas(steps: usize, image_tokens: Option<usize>) -> Result<Vec<f32>, SamplingError> {
    if steps == 0 {
        return Err(SamplingError::InvalidSigmas("0 steps".into()));
    }
    let mu = image_tokens.map(flux_mu);
    let mut out: Vec<f32> = (0..steps)
        .map(|i| {
            // np.linspace(1, 1/steps, steps)
            let s = if steps == 1 {
                1.0
            } else {
                1.0 + (1.0 / steps as f64 - 1.0) * i as f64 / (steps - 1) as f64
            };
            match mu {
                Some(mu) => (mu.exp() / (mu.exp() + (1.0 / s - 1.0))) as f32,
                None => s as f32,
            }
        })
        .collect();
    out.push(0.0);
    Ok(out)
}

/// The `steps + 1` sigmas of a flow model: FLUX.1-dev's resolution shift when
/// `image_tokens` is given, else `linspace(1, 1/steps)` shifted by a constant `shift`
/// (`shift s / (1 + (shift - 1) s)`, SD3's; 1: none), a final 0 appended.
pub fn flow_sigmas(
    steps: usize,
    shift: f32,
    image_tokens: Option<usize>,
) -> Result<Vec<f32>, SamplingError> {
    let mut out = flux_sigmas(steps, image_tokens)?;
    if image_tokens.is_none() && shift != 1.0 {
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

    #[test]
    fn zero_steps_is_an_error() {
        assert!(flux_sigmas(0, None).is_err());
    }
}
