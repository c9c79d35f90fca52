//! The sampler loops, ported step for step from stable-diffusion.cpp's `denoiser.hpp`
//! (itself following k-diffusion's `sampling.py`). Inputs are validated by [`super::sample`].

use sd_tensor::Tensor;

use super::{Denoised, SamplingError};
use crate::rng::Rng;
use crate::schedule::NoiseSchedule;

type Res = Result<Tensor<f32>, SamplingError>;

/// `(x - denoised) / sigma`: the ODE derivative.
/// The per-step callback: `(1-based step, total steps)`, called before each step.
pub(crate) type OnStep<'a> = &'a mut dyn FnMut(usize, usize);

fn deriv(x: &Tensor<f32>, denoised: &Tensor<f32>, sigma: f32) -> Res {
    Ok(x.zip_map(denoised, |a, b| (a - b) / sigma)?)
}

/// `a * x + b * y`.
fn lin(a: f32, x: &Tensor<f32>, b: f32, y: &Tensor<f32>) -> Res {
    Ok(x.axpby(a, y, b)?)
}

/// `x + noise * scale`, the noise drawn from `rng`.
fn add_noise(x: &Tensor<f32>, rng: &mut dyn Rng, scale: f32) -> Res {
    let noise = rng.randn_tensor(x.shape())?;
    lin(1.0, x, scale, &noise)
}

/// sd.cpp's `get_ancestral_step`: `(sigma_down, sigma_up)`.
pub(crate) fn ancestral_step(sigma_from: f32, sigma_to: f32, eta: f32) -> (f32, f32) {
    if eta <= 0.0 {
        return (sigma_to, 0.0);
    }
    let from_sq = sigma_from * sigma_from;
    let to_sq = sigma_to * sigma_to;
    let mut up = 0.0f32;
    if from_sq > 0.0 {
        let term = to_sq * (from_sq - to_sq) / from_sq;
        up = sigma_to.min(eta * term.max(0.0).sqrt());
    }
    let down_sq = to_sq - up * up;
    let down = if down_sq > 0.0 { down_sq.sqrt() } else { 0.0 };
    (down, up)
}

pub(crate) fn euler(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
) -> Res {
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let den = model.denoised(&x, sigma)?;
        let d = deriv(&x, &den, sigma)?;
        x = lin(1.0, &x, next - sigma, &d)?;
    }
    Ok(x)
}

pub(crate) fn euler_ancestral(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: f32,
) -> Res {
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let den = model.denoised(&x, sigma)?;
        if next == 0.0 {
            x = den;
        } else if eta == 0.0 {
            let r = next / sigma;
            x = lin(r, &x, 1.0 - r, &den)?;
        } else if model.flow() {
            x = flow_ancestral_step(&x, &den, sigma, next, eta, rng)?;
        } else {
            let (down, up) = ancestral_step(sigma, next, eta);
            let r = down / sigma;
            x = lin(r, &x, 1.0 - r, &den)?;
            if up > 0.0 {
                x = add_noise(&x, rng, up)?;
            }
        }
    }
    Ok(x)
}

/// One ancestral step of a rectified-flow model from `sigma` to `next` (ComfyUI's
/// `sample_euler_ancestral_RF`, the flow form of k-diffusion's ancestral Euler): step
/// deterministically to `sigma_down = next (1 + (next / sigma - 1) eta)`, then rescale to
/// `next`'s signal level `(1 - next) / (1 - sigma_down)` and add the noise that brings the
/// total back to `next`: `sqrt(next^2 - sigma_down^2 (1 - next)^2 / (1 - sigma_down)^2)`.
fn flow_ancestral_step(
    x: &Tensor<f32>,
    den: &Tensor<f32>,
    sigma: f32,
    next: f32,
    eta: f32,
    rng: &mut dyn Rng,
) -> Res {
    let down = next * (1.0 + (next / sigma - 1.0) * eta);
    let (alpha_next, alpha_down) = (1.0 - next, 1.0 - down);
    let renoise = (next * next - down * down * alpha_next * alpha_next / (alpha_down * alpha_down))
        .max(0.0)
        .sqrt();
    let r = down / sigma;
    let x = lin(r, x, 1.0 - r, den)?.scale(alpha_next / alpha_down);
    if renoise > 0.0 {
        add_noise(&x, rng, renoise)
    } else {
        Ok(x)
    }
}

pub(crate) fn heun(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
) -> Res {
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let den = model.denoised(&x, sigma)?;
        let d = deriv(&x, &den, sigma)?;
        let dt = next - sigma;
        if next == 0.0 {
            x = lin(1.0, &x, dt, &d)?;
        } else {
            let x2 = lin(1.0, &x, dt, &d)?;
            let den2 = model.denoised(&x2, next)?;
            let d2 = deriv(&x2, &den2, next)?;
            let d_avg = lin(0.5, &d, 0.5, &d2)?;
            x = lin(1.0, &x, dt, &d_avg)?;
        }
    }
    Ok(x)
}

pub(crate) fn dpm2(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
) -> Res {
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let den = model.denoised(&x, sigma)?;
        let d = deriv(&x, &den, sigma)?;
        if next == 0.0 {
            x = lin(1.0, &x, next - sigma, &d)?;
        } else {
            let mid = (0.5 * (sigma.ln() + next.ln())).exp();
            let x2 = lin(1.0, &x, mid - sigma, &d)?;
            let den2 = model.denoised(&x2, mid)?;
            let d2 = deriv(&x2, &den2, mid)?;
            x = lin(1.0, &x, next - sigma, &d2)?;
        }
    }
    Ok(x)
}

pub(crate) fn dpmpp_2s_ancestral(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: f32,
) -> Res {
    let t_fn = |s: f32| -s.ln();
    let sigma_fn = |t: f32| (-t).exp();
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let den = model.denoised(&x, sigma)?;
        let (down, up) = ancestral_step(sigma, next, eta);
        if down == 0.0 {
            x = den;
        } else {
            let t = t_fn(sigma);
            let t_next = t_fn(down);
            let h = t_next - t;
            let s = t + 0.5 * h;
            let sigma_s = sigma_fn(s);
            let x2 = lin(sigma_s / sigma_fn(t), &x, -((-h * 0.5).exp() - 1.0), &den)?;
            let den2 = model.denoised(&x2, sigma_s)?;
            x = lin(
                sigma_fn(t_next) / sigma_fn(t),
                &x,
                -((-h).exp() - 1.0),
                &den2,
            )?;
        }
        if next > 0.0 && up > 0.0 {
            x = add_noise(&x, rng, up)?;
        }
    }
    Ok(x)
}

pub(crate) fn dpmpp_2m(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    v2: bool,
) -> Res {
    let t_fn = |s: f32| -s.ln();
    let mut old_den: Option<Tensor<f32>> = None;
    for i in 0..sigmas.len() - 1 {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (sigmas[i], sigmas[i + 1]);
        let den = model.denoised(&x, sigma)?;
        let t = t_fn(sigma);
        let t_next = t_fn(next);
        let h = t_next - t;
        let a = next / sigma;
        match (&old_den, next == 0.0) {
            (Some(old), false) => {
                let h_last = t - t_fn(sigmas[i - 1]);
                let (r, b) = if v2 {
                    let (h_min, h_max) = (h_last.min(h), h_last.max(h));
                    (h_max / h_min, (-(h_max + h_min) / 2.0).exp() - 1.0)
                } else {
                    (h_last / h, (-h).exp() - 1.0)
                };
                let k = 1.0 / (2.0 * r);
                let den_d = lin(1.0 + k, &den, -k, old)?;
                x = lin(a, &x, -b, &den_d)?;
            }
            _ => {
                let b = (-h).exp() - 1.0;
                x = lin(a, &x, -b, &den)?;
            }
        }
        old_den = Some(den);
    }
    Ok(x)
}

pub(crate) fn ipndm(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    variable: bool,
) -> Res {
    const MAX_ORDER: usize = 4;
    let mut hist: Vec<Tensor<f32>> = Vec::with_capacity(MAX_ORDER);
    for i in 0..sigmas.len() - 1 {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (sigmas[i], sigmas[i + 1]);
        let den = model.denoised(&x, sigma)?;
        let d = deriv(&x, &den, sigma)?;
        let order = MAX_ORDER.min(i + 1);
        let dt = next - sigma;
        let n = hist.len();
        // Combination of the current and past derivatives for this order.
        let step = match order {
            1 => d.clone(),
            2 => {
                if variable {
                    let h_prev = sigma - sigmas[i - 1];
                    let q = dt / h_prev;
                    lin((2.0 + q) / 2.0, &d, -q / 2.0, &hist[n - 1])?
                } else {
                    lin(1.5, &d, -0.5, &hist[n - 1])?
                }
            }
            3 => {
                let p = lin(23.0 / 12.0, &d, -16.0 / 12.0, &hist[n - 1])?;
                lin(1.0, &p, 5.0 / 12.0, &hist[n - 2])?
            }
            _ => {
                let p = lin(55.0 / 24.0, &d, -59.0 / 24.0, &hist[n - 1])?;
                let p = lin(1.0, &p, 37.0 / 24.0, &hist[n - 2])?;
                lin(1.0, &p, -9.0 / 24.0, &hist[n - 3])?
            }
        };
        x = lin(1.0, &x, dt, &step)?;
        if hist.len() == MAX_ORDER - 1 {
            hist.remove(0);
        }
        hist.push(d);
    }
    Ok(x)
}

pub(crate) fn lcm(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
) -> Res {
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        x = model.denoised(&x, sigma)?;
        if next > 0.0 {
            // Re-noised to `next`: `x + next noise`, or for a flow model (ComfyUI's
            // `noise_scaling` of `CONST` models) `(1 - next) x + next noise`.
            if model.flow() {
                x = x.scale(1.0 - next);
            }
            x = add_noise(&x, rng, next)?;
        }
    }
    Ok(x)
}

pub(crate) fn tcd(
    model: &mut dyn Denoised,
    on_step: OnStep<'_>,
    mut x: Tensor<f32>,
    sigmas: &[f32],
    rng: &mut dyn Rng,
    eta: f32,
    schedule: &NoiseSchedule,
) -> Res {
    let alphas = schedule.alphas_cumprod();
    for (i, w) in sigmas.windows(2).enumerate() {
        on_step(i + 1, sigmas.len() - 1);
        let (sigma, next) = (w[0], w[1]);
        let prev_t = schedule.nearest_timestep(next);
        let t_s = (((1.0 - eta) * prev_t as f32).floor().max(0.0) as usize).min(alphas.len() - 1);
        let den = model.denoised(&x, sigma)?;
        let d = deriv(&x, &den, sigma)?;
        let alpha_prev = 1.0 / (next * next + 1.0);
        let alpha_s = alphas[t_s] as f32;
        let beta_s = 1.0 - alpha_s;
        x = lin(
            (alpha_s / alpha_prev).sqrt(),
            &den,
            (beta_s / alpha_prev).sqrt(),
            &d,
        )?;
        if eta > 0.0 && next > 0.0 {
            let noise = rng.randn_tensor(x.shape())?;
            let var = (1.0 / alpha_prev - 1.0 / alpha_s).max(0.0);
            x = lin((alpha_prev / alpha_s).sqrt(), &x, var.sqrt(), &noise)?;
        }
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::CpuRng;

    /// A flow "model" whose denoised estimate is half the input.
    struct HalfFlow;

    impl Denoised for HalfFlow {
        fn denoised(&mut self, x: &Tensor<f32>, _sigma: f32) -> Res {
            Ok(x.scale(0.5))
        }

        fn flow(&self) -> bool {
            true
        }
    }

    #[test]
    fn lcm_on_a_flow_model_renoises_the_flow_way() {
        let x = Tensor::new([1, 1, 1, 2], vec![1.0, -2.0]).unwrap();
        let mut rng = CpuRng::new(5);
        let got = lcm(
            &mut HalfFlow,
            &mut |_, _| {},
            x.clone(),
            &[1.0, 0.25, 0.0],
            &mut rng,
        )
        .unwrap();
        // Step 1: denoised 0.5 x, re-noised to 0.25: 0.75 (0.5 x) + 0.25 noise; step 2: half.
        let noise = CpuRng::new(5).randn_tensor(&[1, 1, 1, 2]).unwrap();
        for i in 0..2 {
            let x1 = 0.75 * 0.5 * x.data()[i] + 0.25 * noise.data()[i];
            assert!((got.data()[i] - 0.5 * x1).abs() < 1e-6, "{i}: {got:?}");
        }
    }

    #[test]
    fn euler_a_on_a_flow_model_renoises_the_flow_way() {
        let x = Tensor::new([1, 1, 2, 2], vec![1.0, -2.0, 0.5, 3.0]).unwrap();
        let mut rng = CpuRng::new(3);
        let got = euler_ancestral(
            &mut HalfFlow,
            &mut |_, _| {},
            x.clone(),
            &[1.0, 0.5, 0.0],
            &mut rng,
            1.0,
        )
        .unwrap();
        // Step 1 (1 -> 0.5, eta 1): sigma_down 0.25, x1 = 0.25 x + 0.75 (0.5 x) = 0.625 x,
        // rescaled by (1 - 0.5) / (1 - 0.25), plus noise * sqrt(0.25 - 0.0625 * 0.25 / 0.5625).
        // Step 2 (to 0): the denoised estimate, half of that.
        let mut noise_rng = CpuRng::new(3);
        let noise = noise_rng.randn_tensor(&[1, 1, 2, 2]).unwrap();
        let renoise = (0.25f32 - 0.0625 * 0.25 / 0.5625).sqrt();
        for i in 0..4 {
            let x1 = 0.625 * x.data()[i] * (0.5 / 0.75) + noise.data()[i] * renoise;
            assert!((got.data()[i] - 0.5 * x1).abs() < 1e-5, "{i}: {got:?}");
        }
    }
}
