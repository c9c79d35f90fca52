//! Hires fix on the built-in model: every upscale mode gives an image of the target size; a
//! second pass of strength 0 is the VAE round trip of the upscaled image (so the upscale
//! step feeds the second pass); strength > 0 changes it; the model upscaler runs in the
//! pipeline's runtime; bad settings are clear errors.

use std::path::PathBuf;

use sd_pipeline::generate::{GenerateError, Pipeline, Txt2Img};
use sd_pipeline::hires::{hires_upscale, txt2img_hires, HiresFix, HiresUpscaler, LatentResize};
use sd_pipeline::runtime::RuntimeOptions;
use sd_pipeline::upscale::UpscaleOptions;
use sd_tensor::host::ResampleFilter;

fn pipeline() -> Pipeline {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors");
    Pipeline::load(
        path,
        RuntimeOptions {
            threads: 2,
            ..RuntimeOptions::default()
        },
    )
    .unwrap()
}

fn params() -> Txt2Img {
    Txt2Img {
        prompt: "a green triangle on a black background".into(),
        width: 64,
        height: 64,
        steps: 2,
        seed: 5,
        threads: 2,
        ..Txt2Img::default()
    }
}

fn hires(upscaler: HiresUpscaler, strength: f32) -> HiresFix {
    HiresFix {
        width: 96,
        height: 96,
        steps: 2,
        strength,
        upscaler,
    }
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .sum::<f64>()
        / a.len() as f64
}

#[test]
fn every_upscale_mode_reaches_the_target_size() {
    let mut p = pipeline();
    let model = HiresUpscaler::Model {
        path: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../sd-models/tests/fixtures/upscalers/compact_x2.safetensors"),
        options: UpscaleOptions::default(),
    };
    let mut modes: Vec<HiresUpscaler> = HiresUpscaler::builtin_names()
        .map(|n| HiresUpscaler::builtin(n).unwrap())
        .collect();
    modes.push(model);
    for mode in modes {
        let out =
            txt2img_hires(&mut p, &params(), &hires(mode.clone(), 0.5), &mut |_, _| {}).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].width(), out[0].height()), (96, 96), "{mode:?}");
    }
}

/// Each built-in upscale step is the resize it names: the image ones are PIL's filters on the
/// decoded image, the latent ones torch's modes on its encoding (six modes, at least four
/// different results at 1.5x: bilinear with and without antialiasing agree when enlarging).
#[test]
fn builtin_upscalers_are_the_resizes_they_name() {
    let mut p = pipeline();
    let first = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    let up = |p: &mut Pipeline, name: &str| {
        let mode = HiresUpscaler::builtin(name).unwrap_or_else(|| panic!("{name}"));
        hires_upscale(p, &first, &hires(mode, 0.5), None).unwrap()
    };
    assert_eq!(
        up(&mut p, "lanczos"),
        first
            .resize_filtered(96, 96, ResampleFilter::Lanczos3)
            .unwrap()
    );
    assert_eq!(up(&mut p, "Nearest"), first.resize_nearest(96, 96).unwrap());
    let z = p.encode(&first, None).unwrap();
    let f = p.spec().first_stage.1.downsample_factor();
    let mut latent = Vec::new();
    for (name, mode) in [
        ("Latent", LatentResize::Bilinear),
        ("Latent (antialiased)", LatentResize::BilinearAntialiased),
        ("Latent (bicubic)", LatentResize::Bicubic),
        (
            "Latent (bicubic antialiased)",
            LatentResize::BicubicAntialiased,
        ),
        ("Latent (nearest)", LatentResize::Nearest),
        ("Latent (nearest-exact)", LatentResize::NearestExact),
    ] {
        let want = p
            .decode(&mode.apply(&z, 96 / f, 96 / f).unwrap(), None)
            .unwrap();
        let got = up(&mut p, name);
        assert_eq!(got, want, "{name}");
        if !latent.contains(&got) {
            latent.push(got);
        }
    }
    assert!(
        latent.len() >= 4,
        "only {} different latent resizes",
        latent.len()
    );
    assert!(HiresUpscaler::builtin("Latent (sharp)").is_none());
}

#[test]
fn strength_zero_is_the_round_trip_of_the_upscaled_image() {
    let mut p = pipeline();
    let first = p.txt2img(&params(), &mut |_, _| {}).unwrap().remove(0);
    let h0 = hires(HiresUpscaler::Bilinear, 0.0);
    let up = hires_upscale(&mut p, &first, &h0, None).unwrap();
    let round_trip = {
        let z = p.encode(&up, None).unwrap();
        p.decode(&z, None).unwrap()
    };
    let out = txt2img_hires(&mut p, &params(), &h0, &mut |_, _| {})
        .unwrap()
        .remove(0);
    assert_eq!(out.pixels(), round_trip.pixels());
    // A real second pass changes the image.
    let out = txt2img_hires(
        &mut p,
        &params(),
        &hires(HiresUpscaler::Bilinear, 0.6),
        &mut |_, _| {},
    )
    .unwrap()
    .remove(0);
    let d = mean_abs_diff(out.pixels(), round_trip.pixels());
    assert!(d > 0.5, "second pass changed the image by only {d}");
}

#[test]
fn bad_settings_are_clear_errors() {
    let mut p = pipeline();
    let e = txt2img_hires(
        &mut p,
        &params(),
        &hires(HiresUpscaler::Bilinear, 1.5),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(matches!(e, GenerateError::InvalidSetting { .. }), "{e}");
    let bad = HiresUpscaler::Model {
        path: "/nonexistent/up.pth".into(),
        options: UpscaleOptions::default(),
    };
    let e = txt2img_hires(&mut p, &params(), &hires(bad, 0.5), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/up.pth"), "{e}");
    let mut odd = hires(HiresUpscaler::Latent(LatentResize::Bilinear), 0.5);
    odd.width = 100;
    let e = txt2img_hires(&mut p, &params(), &odd, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("100"), "{e}");
}
