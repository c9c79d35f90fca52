//! Sigma schedules and sigma <-> timestep conversion against the float64 reference of
//! `scripts/fixtures/make_sampling_fixtures.py`.

use sd_pipeline::sampling::SamplingError;
use sd_pipeline::schedule::{AysTable, NoiseSchedule, Scheduler};
use serde_json::Value;

fn fixtures() -> Value {
    serde_json::from_str(include_str!("fixtures/sampling/sampling.json")).unwrap()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-3)
}

#[test]
fn sigma_table_and_conversions_match_reference() {
    let fx = &fixtures()["schedule"];
    let s = NoiseSchedule::scaled_linear();
    assert_eq!(s.len(), 1000);
    for (i, want) in fx["table"].as_object().unwrap() {
        let i: usize = i.parse().unwrap();
        assert!(rel(s.sigmas()[i], want.as_f64().unwrap()) < 1e-12);
    }
    for (i, want) in fx["alphas_cumprod"].as_object().unwrap() {
        let i: usize = i.parse().unwrap();
        assert!(rel(s.alphas_cumprod()[i], want.as_f64().unwrap()) < 1e-12);
    }
    for pair in fx["t_to_sigma"].as_array().unwrap() {
        let (t, want) = (pair[0].as_f64().unwrap(), pair[1].as_f64().unwrap());
        let got = s.t_to_sigma(t as f32) as f64;
        assert!(
            rel(got, want) < 1e-5,
            "t_to_sigma({t}) = {got}, want {want}"
        );
    }
    for pair in fx["sigma_to_t"].as_array().unwrap() {
        let (sigma, want) = (pair[0].as_f64().unwrap(), pair[1].as_f64().unwrap());
        let got = s.sigma_to_t(sigma as f32) as f64;
        assert!(
            (got - want).abs() < 1e-3,
            "sigma_to_t({sigma}) = {got}, want {want}"
        );
    }
    // Round trip.
    for t in [0.0f32, 1.5, 321.25, 998.0] {
        assert!((s.sigma_to_t(s.t_to_sigma(t)) - t).abs() < 1e-2);
    }
}

#[test]
fn schedulers_match_reference() {
    let fx = &fixtures()["schedule"]["schedulers"];
    let s = NoiseSchedule::scaled_linear();
    let mut worst = 0.0f64;
    for (n, entry) in fx.as_object().unwrap() {
        let n: usize = n.parse().unwrap();
        for (name, want) in entry.as_object().unwrap() {
            let sched = match name.as_str() {
                "ays_sd15" => Scheduler::Ays(AysTable::Sd15),
                "ays_sdxl" => Scheduler::Ays(AysTable::Sdxl),
                other => other.parse().unwrap(),
            };
            let got = sched.sigmas(n, &s).unwrap();
            let want: Vec<f64> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert_eq!(got.len(), n + 1, "{name} n={n}");
            assert_eq!(*got.last().unwrap(), 0.0);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = (*g as f64 - w).abs() / w.abs().max(1.0);
                worst = worst.max(e);
                assert!(e < 1e-5, "{name} n={n} [{i}]: {g} vs {w}");
            }
        }
    }
    eprintln!("schedulers: worst error {worst:e}");
}

#[test]
fn schedulers_reject_zero_steps_and_parse_names() {
    let s = NoiseSchedule::scaled_linear();
    for name in [
        "discrete",
        "karras",
        "exponential",
        "ays",
        "sgm_uniform",
        "simple",
        "lcm",
    ] {
        let sched: Scheduler = name.parse().unwrap();
        assert_eq!(sched.name(), name);
        assert!(matches!(sched.sigmas(0, &s), Err(SamplingError::ZeroSteps)));
        let sig = sched.sigmas(30, &s).unwrap();
        assert!(sig.windows(2).all(|w| w[0] >= w[1]), "{name} descending");
        assert!(sig.iter().all(|v| v.is_finite()));
    }
    assert!("bogus".parse::<Scheduler>().is_err());
    assert_eq!(
        Scheduler::from_name("ays", AysTable::Sdxl).unwrap(),
        Scheduler::Ays(AysTable::Sdxl)
    );
    assert!(NoiseSchedule::from_alphas_cumprod(vec![0.5]).is_err());
    assert!(NoiseSchedule::from_alphas_cumprod(vec![0.9, f64::NAN]).is_err());
    assert!(NoiseSchedule::from_alphas_cumprod(vec![0.9, 0.0]).is_err());
}
