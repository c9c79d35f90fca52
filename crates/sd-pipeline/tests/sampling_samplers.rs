//! Samplers on a toy Gaussian-data model: parity with the k-diffusion-style loops of
//! `scripts/fixtures/make_sampling_fixtures.py`, and every sampler converging without NaN.

use sd_pipeline::rng::{CpuRng, Rng};
use sd_pipeline::sampling::{
    sample, sample_with_progress, Denoise, Denoised, KDenoiser, Prediction, SampleMethod,
    SamplingError,
};
use sd_pipeline::schedule::{NoiseSchedule, Scheduler};
use sd_tensor::Tensor;
use serde_json::Value;

fn fixtures() -> Value {
    serde_json::from_str(include_str!("fixtures/sampling/sampling.json")).unwrap()
}

const SHAPE: [usize; 4] = [1, 4, 8, 8];

fn mu() -> Tensor<f32> {
    let n: usize = SHAPE.iter().product();
    Tensor::new(
        SHAPE.to_vec(),
        (0..n).map(|i| (0.1 * i as f64).sin() as f32).collect(),
    )
    .unwrap()
}

/// The optimal denoiser of `N(mu, s0^2)` data, exposed as an eps or v model:
/// `D(x; sigma) = mu + s0^2 / (s0^2 + sigma^2) (x - mu)` (same as the Python script).
struct Toy {
    mu: Tensor<f32>,
    s0: f32,
    prediction: Prediction,
    calls: usize,
}

impl Toy {
    fn new(s0: f32, prediction: Prediction) -> Self {
        Toy {
            mu: mu(),
            s0,
            prediction,
            calls: 0,
        }
    }
}

impl Denoise for Toy {
    fn predict(
        &mut self,
        x_in: &Tensor<f32>,
        sigma: f32,
        _timestep: f32,
    ) -> Result<Tensor<f32>, SamplingError> {
        self.calls += 1;
        let sc = self.prediction.scalings(sigma);
        let x = x_in.scale(1.0 / sc.c_in);
        let k = self.s0 * self.s0 / (self.s0 * self.s0 + sigma * sigma);
        let den = x.zip_map(&self.mu, |x, m| m + k * (x - m))?;
        // Invert D = c_skip x + c_out F for the model output F.
        Ok(x.zip_map(&den, |x, d| (d - sc.c_skip * x) / sc.c_out)?)
    }
}

fn run(
    method: SampleMethod,
    prediction: Prediction,
    s0: f32,
    sigmas: &[f32],
    seed: u64,
) -> Result<Tensor<f32>, SamplingError> {
    let schedule = NoiseSchedule::scaled_linear();
    let mut rng = CpuRng::new(seed);
    let x = rng.randn_tensor(&SHAPE)?.scale(sigmas[0]);
    let mut model = KDenoiser::new(Toy::new(s0, prediction), prediction, &schedule);
    sample(method, &mut model, x, sigmas, &mut rng, None, &schedule)
}

#[test]
fn four_step_runs_match_python_reference() {
    let fx = &fixtures()["toy"];
    let s0 = fx["s0"].as_f64().unwrap() as f32;
    let schedule = NoiseSchedule::scaled_linear();
    for r in fx["runs"].as_array().unwrap() {
        let method: SampleMethod = r["sampler"].as_str().unwrap().parse().unwrap();
        let sched: Scheduler = r["scheduler"].as_str().unwrap().parse().unwrap();
        let ref_sigmas: Vec<f32> = r["sigmas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let sigmas = sched.sigmas(4, &schedule).unwrap();
        for (a, b) in sigmas.iter().zip(&ref_sigmas) {
            assert!((a - b).abs() <= 1e-5 * b.max(1.0));
        }
        let want = Tensor::new(
            SHAPE.to_vec(),
            r["out"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect(),
        )
        .unwrap();
        let seed = r["seed"].as_u64().unwrap();
        for prediction in [Prediction::Eps, Prediction::V] {
            let got = run(method, prediction, s0, &sigmas, seed).unwrap();
            let rel = got.rel_l2(&want).unwrap();
            let max_abs = got.max_abs_diff(&want).unwrap();
            eprintln!(
                "{} / {} / {prediction:?}: rel_l2 {rel:e}, max_abs {max_abs:e}",
                method.name(),
                sched.name()
            );
            assert!(rel < 1e-3, "{}: rel {rel}", method.name());
        }
    }
}

#[test]
fn every_sampler_converges_to_the_toy_fixed_point() {
    let schedule = NoiseSchedule::scaled_linear();
    let s0 = 0.02;
    let target = mu();
    for method in SampleMethod::ALL {
        for steps in [4usize, 20] {
            let sigmas = method.default_scheduler().sigmas(steps, &schedule).unwrap();
            let karras = Scheduler::Karras.sigmas(steps, &schedule).unwrap();
            for sig in [&sigmas, &karras] {
                let out = run(method, Prediction::Eps, s0, sig, 3).unwrap();
                assert!(out.all_finite(), "{} produced NaN/inf", method.name());
                let dist = out.sub(&target).unwrap().abs_max();
                eprintln!("{} {steps} steps: max |x - mu| = {dist:.4}", method.name());
                assert!(
                    dist < 0.25,
                    "{} {steps}: max |x - mu| = {dist}",
                    method.name()
                );
            }
        }
    }
}

#[test]
fn samplers_reject_bad_input() {
    let schedule = NoiseSchedule::scaled_linear();
    let x = Tensor::zeros(SHAPE.to_vec()).unwrap();
    let mut rng = CpuRng::new(0);
    let mut toy = KDenoiser::new(Toy::new(0.5, Prediction::Eps), Prediction::Eps, &schedule);
    let cases: [(&[f32], Option<f32>); 6] = [
        (&[], None),
        (&[1.0], None),
        (&[1.0, f32::NAN, 0.0], None),
        (&[1.0, 0.0, 0.0], None),
        (&[1.0, 2.0, 0.0], None),
        (&[2.0, 1.0, 0.0], Some(-1.0)),
    ];
    for method in SampleMethod::ALL {
        for (sig, eta) in cases {
            let r = sample(method, &mut toy, x.clone(), sig, &mut rng, eta, &schedule);
            assert!(r.is_err(), "{} accepted {sig:?}", method.name());
        }
        assert_eq!(method.name().parse::<SampleMethod>().unwrap(), method);
    }
    assert!(matches!(
        sample(
            SampleMethod::Euler,
            &mut toy,
            x.clone(),
            &[1.0],
            &mut rng,
            None,
            &schedule
        ),
        Err(SamplingError::ZeroSteps)
    ));
    // A model returning the wrong shape is an error, not a panic.
    let mut bad = |_: &Tensor<f32>, _: f32| Ok(Tensor::zeros(vec![3]).unwrap());
    let bad: &mut dyn Denoised = &mut bad;
    let r = sample(
        SampleMethod::Euler,
        bad,
        x,
        &[1.0, 0.0],
        &mut rng,
        None,
        &schedule,
    );
    assert!(r.is_err());
    assert!("dpm++3m".parse::<SampleMethod>().is_err());
}

#[test]
fn heun_calls_the_model_twice_per_non_final_step() {
    let schedule = NoiseSchedule::scaled_linear();
    let sigmas = Scheduler::Karras.sigmas(5, &schedule).unwrap();
    let mut rng = CpuRng::new(1);
    let x = rng.randn_tensor(&SHAPE).unwrap().scale(sigmas[0]);
    let mut model = KDenoiser::new(Toy::new(0.5, Prediction::Eps), Prediction::Eps, &schedule);
    sample(
        SampleMethod::Heun,
        &mut model,
        x,
        &sigmas,
        &mut rng,
        None,
        &schedule,
    )
    .unwrap();
    assert_eq!(model.model.calls, 9);
}

/// Every sampler reports each step once, in order: `(1, n) .. (n, n)`.
#[test]
fn samplers_report_every_step_in_order() {
    let schedule = NoiseSchedule::scaled_linear();
    let sigmas = Scheduler::Karras.sigmas(5, &schedule).unwrap();
    for method in SampleMethod::ALL {
        let mut rng = CpuRng::new(3);
        let x = rng.randn_tensor(&SHAPE).unwrap().scale(sigmas[0]);
        let mut model = KDenoiser::new(Toy::new(0.5, Prediction::Eps), Prediction::Eps, &schedule);
        let mut seen = Vec::new();
        sample_with_progress(
            method,
            &mut model,
            x,
            &sigmas,
            &mut rng,
            None,
            &schedule,
            &mut |step, total| seen.push((step, total)),
        )
        .unwrap();
        let want: Vec<(usize, usize)> = (1..=5).map(|i| (i, 5)).collect();
        assert_eq!(seen, want, "{}", method.name());
        assert!(model.model.calls >= 5, "{}", method.name());
    }
}
