//! `cpu` RNG against torch.randn, `cuda` Philox core against Random123's known answers.

use sd_pipeline::rng::{CpuRng, CudaRng, Rng, RngKind};
use serde_json::Value;

fn fixtures() -> Value {
    let text = include_str!("fixtures/sampling/sampling.json");
    serde_json::from_str(text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(err <= 1e-5, "{what}[{i}]: {g} vs torch {w}");
        worst = worst.max(err);
    }
    worst
}

#[test]
fn cpu_rng_matches_torch_randn() {
    let fx = fixtures();
    let mut worst = 0.0f32;
    for case in fx["rng"]["cases"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let shape: Vec<usize> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let stride = case["stride"].as_u64().unwrap() as usize;
        let want = floats(&case["values"]);
        let mut rng = CpuRng::new(seed);
        let t = rng.randn_tensor(&shape).unwrap();
        let got: Vec<f32> = t.data().iter().step_by(stride).copied().collect();
        worst = worst.max(assert_close(
            &got,
            &want,
            &format!("seed {seed} shape {shape:?}"),
        ));
    }
    eprintln!("cpu rng: worst relative error vs torch {worst:e}");
}

#[test]
fn cpu_rng_stream_matches_one_torch_generator() {
    let fx = fixtures();
    let seq = &fx["rng"]["sequence"];
    let mut rng = CpuRng::new(seq["seed"].as_u64().unwrap());
    for (shape, want) in seq["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .zip(seq["values"].as_array().unwrap())
    {
        let n = shape[0].as_u64().unwrap() as usize;
        assert_close(&rng.randn(n), &floats(want), &format!("draw of {n}"));
    }
}

#[test]
fn manual_seed_restarts_the_stream() {
    for kind in [RngKind::Cpu, RngKind::Cuda] {
        let mut rng = kind.create(5);
        let a = rng.randn(40);
        rng.manual_seed(5);
        assert_eq!(a, rng.randn(40), "{kind:?}");
        assert!(rng.randn(0).is_empty());
    }
    assert_eq!("cpu".parse::<RngKind>().unwrap(), RngKind::Cpu);
    assert_eq!("cuda".parse::<RngKind>().unwrap(), RngKind::Cuda);
    assert!("gpu".parse::<RngKind>().is_err());
}

/// Random123's published known-answer vectors for Philox4x32-10 (tests/kat_vectors).
#[test]
fn philox_core_matches_random123_known_answers() {
    let kats: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        (
            [0, 0, 0, 0],
            [0, 0],
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
        ),
        (
            [0xffffffff; 4],
            [0xffffffff; 2],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    for (ctr, key, want) in kats {
        assert_eq!(CudaRng::philox4x32_10(ctr, key), want);
    }
}

#[test]
fn cuda_rng_is_standard_normal() {
    let mut rng = CudaRng::new(42);
    let v = rng.randn(1 << 16);
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    assert!(mean.abs() < 0.02, "mean {mean}");
    assert!((var - 1.0).abs() < 0.03, "var {var}");
    assert!(v.iter().all(|x| x.is_finite()));
    // A second call uses the next offset: a different block.
    assert_ne!(rng.randn(16), CudaRng::new(42).randn(16));
}

/// `cuda` RNG against `scripts/fixtures/make_philox_fixtures.py`: a pure-Python Philox4x32-10
/// (checked there against Random123's known answers) with sd.cpp's / AUTOMATIC1111's counter
/// layout and Box-Muller, for four seeds (one above 2^32: the key's high word), two successive
/// calls each (the counter's offset word), and a 4x64x64 latent sampled every 97th value.
/// Plus the one published torch CUDA sample (seed 0, 3x4; AUTOMATIC1111's `rng_philox.py`
/// docstring). No GPU was used: agreement with torch on a GPU rests on that sample.
#[test]
fn cuda_rng_matches_the_philox_reference() {
    let fx: Value = serde_json::from_str(include_str!("fixtures/sampling/philox.json")).unwrap();
    let published = floats(&fx["published_seed0_3x4"]);
    let got = CudaRng::new(0).randn_tensor(&[3, 4]).unwrap();
    assert_close(got.data(), &published, "seed 0 [3, 4] vs torch CUDA");
    let mut worst = 0.0f32;
    for case in fx["cases"].as_array().unwrap() {
        let seed = case["seed"].as_u64().unwrap();
        let mut rng = RngKind::Cuda.create(seed);
        for (k, draw) in case["draws"].as_array().unwrap().iter().enumerate() {
            let n = draw["n"].as_u64().unwrap() as usize;
            let what = format!("seed {seed} call {k}");
            worst = worst.max(assert_close(&rng.randn(n), &floats(&draw["values"]), &what));
        }
    }
    let latent = &fx["latent"];
    let n = latent["n"].as_u64().unwrap() as usize;
    let stride = latent["stride"].as_u64().unwrap() as usize;
    let all = CudaRng::new(latent["seed"].as_u64().unwrap()).randn(n);
    let got: Vec<f32> = all.iter().step_by(stride).copied().collect();
    worst = worst.max(assert_close(&got, &floats(&latent["values"]), "latent"));
    eprintln!("cuda rng: worst relative error vs the reference {worst:e}");
}
