//! The `sd` binary end to end: device listing, the ggml self-check, generation with the
//! built-in model, and flag and file errors.

use std::process::Command;

fn sd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd"))
}

#[test]
fn lists_devices_and_self_checks() {
    let out = sd()
        .args(["--list-devices", "--self-check", "-t", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("CPU"), "{text}");
    assert!(text.contains("self-check"), "{text}");
}

#[test]
fn bad_flags_are_clear_errors() {
    let out = sd().arg("--no-such-flag").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"));
    let out = sd().args(["-t", "zero"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--threads"));
}

fn builtin_model() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("sd-cli-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    path
}

#[test]
fn generates_a_red_circle_with_the_builtin_model() {
    let out_path = scratch("red_circle.png");
    let start = std::time::Instant::now();
    let out = sd()
        .arg("-m")
        .arg(builtin_model())
        .args(["-p", "a red circle on a white background", "--steps", "12"])
        .args([
            "-W", "64", "-H", "64", "-s", "0", "--rng", "cpu", "-t", "2", "-o",
        ])
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("generation took {:.2} s", start.elapsed().as_secs_f64());
    let (img, text) = sd_tensor::Image::load_png_with_text(&out_path).unwrap();
    assert_eq!((img.width(), img.height()), (64, 64));
    let params = &text.iter().find(|(k, _)| k == "parameters").unwrap().1;
    assert!(
        params.starts_with("a red circle on a white background\nSteps: 12, Sampler: euler, CFG scale: 5, Seed: 0, Size: 64x64, Model: sd-rs-shapes"),
        "{params}"
    );
    let px = |x: usize, y: usize| {
        let p = img.pixel(x, y).unwrap();
        (p[0], p[1], p[2])
    };
    // Centre 16x16: mostly red (the model places shapes anywhere; seed 0 centres this one).
    let mut red = 0;
    for y in 24..40 {
        for x in 24..40 {
            let (r, g, b) = px(x, y);
            red += usize::from(r > 150 && g < 100 && b < 100);
        }
    }
    assert!(red * 10 >= 256 * 8, "{red}/256 red centre pixels");
    // 2-pixel border: mostly white.
    let (mut white, mut border) = (0, 0);
    for y in 0..64 {
        for x in 0..64 {
            if x < 2 || y < 2 || x >= 62 || y >= 62 {
                let (r, g, b) = px(x, y);
                border += 1;
                white += usize::from(r > 200 && g > 200 && b > 200);
            }
        }
    }
    assert!(
        white * 10 >= border * 8,
        "{white}/{border} white border pixels"
    );
}

#[test]
fn a_missing_model_file_is_exit_1_naming_it() {
    let out_path = scratch("missing.png");
    let out = sd()
        .args([
            "-m",
            "no/such/model.safetensors",
            "-p",
            "a red circle on a white background",
            "-o",
        ])
        .arg(&out_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no/such/model.safetensors"), "{err}");
    assert!(!out_path.exists());
}

#[test]
fn a_corrupt_model_file_is_exit_1_naming_it() {
    let bad = scratch("corrupt.safetensors");
    std::fs::write(&bad, b"\x10\0\0\0\0\0\0\0{not json at all").unwrap();
    let out_path = scratch("corrupt.png");
    let out = sd()
        .arg("-m")
        .arg(&bad)
        .args(["-p", "a red circle on a white background", "-o"])
        .arg(&out_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("corrupt.safetensors"), "{err}");
    assert!(!out_path.exists());
}

#[test]
fn bad_generation_values_are_exit_2() {
    let out_path = scratch("bad.png");
    for (args, flag) in [
        (&["--steps", "zero"][..], "--steps"),
        (&["--steps", "0"][..], "--steps"),
        (&["-W", "70"][..], "-W/--width"),
        (&["--sampling-method", "nope"][..], "--sampling-method"),
        (&["--cfg-scale", "x"][..], "--cfg-scale"),
    ] {
        let out = sd()
            .arg("-m")
            .arg(builtin_model())
            .args(["-p", "a red circle on a white background", "-o"])
            .arg(&out_path)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(!out_path.exists());
    }
    let out = sd().args(["-p", "a red circle"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("-m/--model"));
}

/// Runs `sd` on the built-in model (64x64, 3 steps, seed 5) writing `out`, with `extra`.
fn run_builtin(out_path: &std::path::Path, extra: &[&str]) -> std::process::Output {
    run_builtin_env(out_path, extra, &[])
}

/// [`run_builtin`] with environment variables `env`.
fn run_builtin_env(
    out_path: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    sd().envs(env.iter().copied())
        .arg("-m")
        .arg(builtin_model())
        .args(["-p", "a yellow circle on a blue background", "--steps", "3"])
        .args(["-W", "64", "-H", "64", "-s", "5", "-t", "2", "-o"])
        .arg(out_path)
        .args(extra)
        .output()
        .unwrap()
}

/// The largest difference between two images' pixel values.
fn max_pixel_diff(a: &sd_tensor::Image, b: &sd_tensor::Image) -> i32 {
    a.pixels()
        .iter()
        .zip(b.pixels())
        .map(|(p, q)| (*p as i32 - *q as i32).abs())
        .max()
        .unwrap()
}

fn ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_budgeted_simulated_device_gives_the_cpu_image() {
    // ggml's ops only on the CPU (SD_HOST_KERNELS=0): the bits the simulated device computes.
    let cpu_png = scratch("budget_cpu.png");
    ok(&run_builtin_env(&cpu_png, &[], &[("SD_HOST_KERNELS", "0")]));
    // 8 MiB: less than the UNet's or the VAE decoder's weights + workspace (7-9 MB at 64x64
    // with the engine's 128 MiB planning headroom), so they run in segments.
    // Whole ops (SD_BANDS=0): bands would sum some products in another order.
    let sim_png = scratch("budget_sim.png");
    let budgeted = [
        "--backend",
        "sim:256",
        "--max-vram",
        "8M",
        "--params-backend",
        "disk",
    ];
    let out = run_builtin_env(&sim_png, &budgeted, &[("SD_BANDS", "0")]);
    ok(&out);
    // Streaming under the budget is no warning: prefetches that find no room are skipped,
    // cuts merged segments hold inside are the model's business.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("WARN"), "{err}");
    let a = sd_tensor::Image::load_png(&cpu_png).unwrap();
    let b = sd_tensor::Image::load_png(&sim_png).unwrap();
    assert_eq!(a.pixels(), b.pixels());
    // With bands (the default): the VAE decoder's convolutions in row bands, the same image
    // to within rounding.
    let banded_png = scratch("budget_bands.png");
    ok(&run_builtin(&banded_png, &budgeted));
    let d = sd_tensor::Image::load_png(&banded_png).unwrap();
    let max = max_pixel_diff(&a, &d);
    assert!(max <= 2, "bands: max pixel diff {max}");
    // The project's CPU kernels (the default; the attention rounds otherwise): the same
    // image to within rounding.
    let host_png = scratch("budget_host.png");
    ok(&run_builtin(&host_png, &[]));
    let c = sd_tensor::Image::load_png(&host_png).unwrap();
    let max = max_pixel_diff(&a, &c);
    assert!(max <= 8, "host kernels: max pixel diff {max}");
    // The kernels with ggml's f16 product instead of the f32 products (`SD_F32_PRODUCTS=0`;
    // the VAE decoder's 64x64 convolutions run without im2col by default): within rounding.
    let f16_png = scratch("budget_f16_products.png");
    ok(&run_builtin_env(&f16_png, &[], &[("SD_F32_PRODUCTS", "0")]));
    let d = sd_tensor::Image::load_png(&f16_png).unwrap();
    let max = max_pixel_diff(&d, &c);
    assert!(max <= 8, "f16 products: max pixel diff {max}");
    let out = run_builtin_env(
        &scratch("budget_bad_f32.png"),
        &[],
        &[("SD_F32_PRODUCTS", "2")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("SD_F32_PRODUCTS=2"));
    // A bad value is a usage error that writes nothing.
    let bad = scratch("budget_bad_env.png");
    let out = run_builtin_env(&bad, &[], &[("SD_HOST_KERNELS", "maybe")]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SD_HOST_KERNELS=maybe"), "{err}");
    assert!(!bad.exists());
    // An impossible budget is a clear error before any work (the memory preflight: exit 2)
    // and writes nothing.
    let none = scratch("budget_none.png");
    let out = run_builtin(&none, &["--backend", "sim:256", "--max-vram", "1M"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("budget"), "{err}");
    assert!(!none.exists());
}

#[test]
fn img2img_and_batches_write_every_image() {
    let init = scratch("init.png");
    ok(&run_builtin(&init, &[]));
    let out_path = scratch("i2i.png");
    let second = scratch("i2i_2.png");
    let _ = std::fs::remove_file(&second);
    let out = sd()
        .arg("-m")
        .arg(builtin_model())
        .args(["-p", "a yellow square on a blue background", "--steps", "4"])
        .args([
            "-s",
            "1",
            "-t",
            "2",
            "-b",
            "2",
            "--strength",
            "0.5",
            "--mmap",
        ])
        .args([
            "--vae-tiling",
            "--rng",
            "cuda",
            "--clip-skip",
            "1",
            "--type",
            "f32",
        ])
        .arg("-i")
        .arg(&init)
        .arg("-o")
        .arg(&out_path)
        .output()
        .unwrap();
    ok(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("i2i_2.png"), "{stdout}");
    for (path, seed) in [(&out_path, 1), (&second, 2)] {
        let (img, text) = sd_tensor::Image::load_png_with_text(path).unwrap();
        // The size comes from the init image.
        assert_eq!((img.width(), img.height()), (64, 64));
        let params = &text.iter().find(|(k, _)| k == "parameters").unwrap().1;
        assert!(params.contains(&format!("Seed: {seed},")), "{params}");
        assert!(params.contains("Denoising strength: 0.5"), "{params}");
    }
}

#[test]
fn file_and_value_errors_are_clear_and_write_nothing() {
    let out_path = scratch("errors.png");
    // Truncated model: exit 1 naming the file.
    let bytes = std::fs::read(builtin_model()).unwrap();
    let truncated = scratch("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let out = sd()
        .arg("-m")
        .arg(&truncated)
        .args(["-p", "a red circle on a white background", "-o"])
        .arg(&out_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("truncated.safetensors"), "{err}");
    assert!(!out_path.exists());

    // A missing component file: exit 1 naming it.
    let out = run_builtin(&out_path, &["--vae", "no/such/vae.safetensors"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no/such/vae.safetensors"));
    // A missing init image: exit 1 naming it.
    let out = run_builtin(&out_path, &["-i", "no/such/init.png"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no/such/init.png"));
    assert!(!out_path.exists());

    // An output in a directory that does not exist: exit 2 before any work.
    let nowhere = scratch("no-such-dir").join("out.png");
    let out = run_builtin(&nowhere, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-o/--output") && err.contains("no-such-dir"),
        "{err}"
    );
    assert!(!nowhere.exists());

    // Bad values: exit 2 naming the flag.
    for (args, flag) in [
        (&["--backend", "sim:lots"][..], "--backend"),
        (&["--backend", "NoSuchDevice9"][..], "NoSuchDevice9"),
        (&["--max-vram", "much"][..], "--max-vram"),
        (&["--type", "q9_9"][..], "--type"),
        (&["--rng", "gpu"][..], "--rng"),
        (&["--params-backend", "tape"][..], "--params-backend"),
        (&["--strength", "0.5"][..], "--strength"),
        (&["-b", "0"][..], "--batch-count"),
        (&["--clip-skip", "9"][..], "--clip-skip"),
    ] {
        let out = run_builtin(&out_path, args);
        let code = if flag == "NoSuchDevice9" { 1 } else { 2 };
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(!out_path.exists(), "{args:?}");
    }
}
