//! `sd upscale` and `--upscale-model` after generation, end to end, with the tiny upscaler
//! fixtures of `sd-models`.

use std::path::{Path, PathBuf};
use std::process::Command;

use sd_tensor::Image;

fn sd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/upscalers")
        .join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sd-cli-upscale-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    path
}

fn input_png(name: &str, w: usize, h: usize, alpha: bool) -> PathBuf {
    let c = if alpha { 4 } else { 3 };
    let px: Vec<u8> = (0..w * h * c).map(|i| (i * 37 % 251) as u8).collect();
    let img = Image::new(w, h, c, px).unwrap();
    let p = scratch(name);
    img.save_png(&p, &[("parameters".into(), "a test".into())])
        .unwrap();
    p
}

#[test]
fn upscale_mode_writes_the_upscaled_png() {
    let input = input_png("in_rgba.png", 21, 13, true);
    let output = scratch("out_rgba.png");
    let out = sd()
        .args(["upscale", "--upscale-model"])
        .arg(fixture("compact_x2.safetensors"))
        .args([
            "--upscale-repeats",
            "2",
            "--upscale-tile-size",
            "16",
            "-t",
            "2",
            "-i",
        ])
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (img, text) = Image::load_png_with_text(&output).unwrap();
    assert_eq!((img.width(), img.height(), img.channels()), (84, 52, 4));
    let params = &text.iter().find(|(k, _)| k == "parameters").unwrap().1;
    assert!(params.starts_with("a test"), "{params}");
    assert!(params.contains("Upscaler: compact_x2"), "{params}");

    // sd.cpp's spelling of the mode.
    let output2 = scratch("out_mode.png");
    let out = sd()
        .args(["-M", "upscale", "--upscale-model"])
        .arg(fixture("esrgan_old.pth"))
        .arg("-i")
        .arg(input_png("in_rgb.png", 5, 4, false))
        .arg("-o")
        .arg(&output2)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let img = Image::load_png(&output2).unwrap();
    assert_eq!((img.width(), img.height(), img.channels()), (20, 16, 3));
}

#[test]
fn upscale_flag_errors() {
    let input = input_png("in_flags.png", 4, 4, false);
    let model = fixture("compact_x2.safetensors");
    let cases: Vec<(Vec<std::ffi::OsString>, &str)> = vec![
        (
            vec!["upscale".into(), "-i".into(), input.clone().into()],
            "--upscale-model",
        ),
        (
            vec![
                "upscale".into(),
                "--upscale-model".into(),
                model.clone().into(),
            ],
            "-i/--init-img",
        ),
        (
            vec![
                "upscale".into(),
                "--upscale-model".into(),
                model.clone().into(),
                "-i".into(),
                input.clone().into(),
                "--upscale-repeats".into(),
                "0".into(),
            ],
            "--upscale-repeats",
        ),
        (
            vec!["--upscale-tile-size".into(), "64".into()],
            "--upscale-model",
        ),
        (
            vec![
                "upscale".into(),
                "--upscale-model".into(),
                model.clone().into(),
                "-i".into(),
                input.clone().into(),
                "-M".into(),
                "vid_gen".into(),
            ],
            "not supported yet",
        ),
    ];
    for (args, needle) in cases {
        let out = sd().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn corrupt_model_or_input_fails_cleanly() {
    let good = std::fs::read(fixture("compact_x4.pth")).unwrap();
    let bad_model = scratch("cut-model.pth");
    std::fs::write(&bad_model, &good[..good.len() / 3]).unwrap();
    let input = input_png("in_corrupt.png", 6, 6, false);
    let output = scratch("never.png");
    let out = sd()
        .args(["upscale", "--upscale-model"])
        .arg(&bad_model)
        .arg("-i")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cut-model.pth"), "{err}");
    assert!(!output.exists());

    let bad_png = scratch("cut.png");
    let bytes = std::fs::read(&input).unwrap();
    std::fs::write(&bad_png, &bytes[..bytes.len() / 2]).unwrap();
    let out = sd()
        .args(["upscale", "--upscale-model"])
        .arg(fixture("compact_x4.pth"))
        .arg("-i")
        .arg(&bad_png)
        .arg("-o")
        .arg(&output)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cut.png"), "{err}");
    assert!(!output.exists());
}

#[test]
fn generation_then_upscale() {
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin/sd-rs-shapes.safetensors");
    let output = scratch("gen_up.png");
    let out = sd()
        .arg("-m")
        .arg(model)
        .args(["-p", "a red circle on a white background", "--steps", "2"])
        .args(["-W", "64", "-H", "64", "-s", "0", "-t", "2", "-o"])
        .arg(&output)
        .arg("--upscale-model")
        .arg(fixture("compact_x2.safetensors"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (img, text) = Image::load_png_with_text(&output).unwrap();
    assert_eq!((img.width(), img.height()), (128, 128));
    let params = &text.iter().find(|(k, _)| k == "parameters").unwrap().1;
    assert!(
        params.contains("red circle") && params.contains("Upscaler"),
        "{params}"
    );
}

#[test]
fn generation_then_upscale_on_a_budgeted_simulated_device() {
    // The upscaler runs in the generation's runtime, under its --max-vram budget.
    let model =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin/sd-rs-shapes.safetensors");
    let output = scratch("gen_up_sim.png");
    let out = sd()
        .arg("-m")
        .arg(model)
        .args(["-p", "a blue square on a yellow background", "--steps", "2"])
        .args(["-W", "64", "-H", "64", "-s", "1", "-t", "2", "-v"])
        .args(["--backend", "sim:256", "--max-vram", "12M", "-o"])
        .arg(&output)
        .arg("--upscale-model")
        .arg(fixture("esrgan_old.pth"))
        .args(["--upscale-tile-size", "32"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("upscaled 1 image(s)"), "{err}");
    let img = Image::load_png(&output).unwrap();
    assert_eq!((img.width(), img.height()), (256, 256));
}
