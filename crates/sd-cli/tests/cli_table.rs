//! The `sd` command line, one row per case: the exit code, words of the message, and the
//! files in the case's own directory afterwards (nothing written where it must not be).
//! Generation rows use the built-in tiny model at 64x64 with 1-2 steps.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/builtin/sd-rs-shapes.safetensors")
}

fn upscaler() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-models/tests/fixtures/upscalers/compact_x2.safetensors")
}

fn sdxl_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../sd-pipeline/tests/fixtures/pipeline")
        .join(name)
}

/// Arguments of a 2-step 32x32 generation with the tiny SDXL base writing `out`.
fn sdxl_gen(out: impl AsRef<OsStr>) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["-m".into(), sdxl_fixture("tiny_sdxl.safetensors").into()];
    for a in [
        "-p",
        "a lighthouse",
        "--steps",
        "2",
        "-W",
        "32",
        "-H",
        "32",
        "-t",
        "2",
        "--cfg-scale",
        "5",
    ] {
        v.push(a.into());
    }
    v.push("-o".into());
    v.push(out.as_ref().to_owned());
    v
}

/// Arguments of a 32x32 generation with the tiny FLUX.1-dev checkpoint `d/flux.safetensors`
/// ("a red fox", 2 threads) writing `d/out`, then `extra`.
fn flux_gen(d: &Path, out: &str, extra: &[&str]) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["-m".into(), d.join("flux.safetensors").into()];
    for a in ["-p", "a red fox", "-W", "32", "-H", "32", "-t", "2"] {
        v.push(a.into());
    }
    v.extend(extra.iter().map(OsString::from));
    v.push("-o".into());
    v.push(d.join(out).into());
    v
}

/// Writes the tiny FLUX.1-dev checkpoint (token embeddings made whole) as
/// `d/flux.safetensors`.
fn flux_setup(d: &Path) {
    files::expand_sparse(
        &sdxl_fixture("tiny_flux.safetensors"),
        &d.join("flux.safetensors"),
    );
}

/// The sd-pipeline tests' fixture-file rewriting (sparse vocabularies, component files).
#[allow(dead_code)]
#[path = "../../sd-pipeline/tests/common/files.rs"]
mod files;

/// Writes the tiny SD3.5 single file (token embeddings made whole) as `d/sd3.safetensors`.
fn sd3_setup(d: &Path) {
    files::expand_sparse(
        &sdxl_fixture("tiny_sd3.safetensors"),
        &d.join("sd3.safetensors"),
    );
}

/// [`sd3_setup`], then each component in a file of its own: `dit`, `l`, `g`, `t5`, `vae`
/// (`.safetensors`), each with the checkpoint's sd-rs metadata.
fn sd3_components(d: &Path) {
    sd3_setup(d);
    let whole = d.join("sd3.safetensors");
    for (name, prefix) in [
        ("dit", "model.diffusion_model."),
        ("l", "text_encoders.clip_l."),
        ("g", "text_encoders.clip_g."),
        ("t5", "text_encoders.t5xxl."),
        ("vae", "vae."),
    ] {
        files::only(&whole, &[prefix], &d.join(format!("{name}.safetensors")));
    }
}

/// Writes the tiny Qwen-Image checkpoint's parts as users download them, bare names each:
/// `d/qwen_dit.safetensors` (the transformer), `d/qwen_llm.safetensors` (the Qwen2.5-VL text
/// model, Hugging Face names), `d/qwen_vae.safetensors` (the Wan VAE, diffusers names).
fn qwen_parts(d: &Path) {
    let whole = d.join("qwen.safetensors");
    files::expand_sparse(&sdxl_fixture("tiny_qwen_image.safetensors"), &whole);
    for (name, prefix) in [
        ("qwen_dit", "model.diffusion_model."),
        ("qwen_llm", "text_encoders.llm."),
        ("qwen_vae", "vae."),
    ] {
        files::strip(&whole, prefix, &d.join(format!("{name}.safetensors")));
    }
    std::fs::remove_file(whole).unwrap();
}

/// [`qwen_parts`], with `d/qwen_llm.safetensors` replaced by the tiny SD3's CLIP-L (bare
/// transformers names): the wrong text encoder for `--llm`.
fn qwen_parts_clip_as_llm(d: &Path) {
    qwen_parts(d);
    let sd3 = d.join("sd3.safetensors");
    files::expand_sparse(&sdxl_fixture("tiny_sd3.safetensors"), &sd3);
    files::strip(
        &sd3,
        "text_encoders.clip_l.transformer.",
        &d.join("qwen_llm.safetensors"),
    );
    std::fs::remove_file(sd3).unwrap();
}

/// Arguments of a 2-step 32x32 Qwen-Image generation from its parts in `d` ("a cat",
/// negative "blurry", CFG 2.5) writing `d/o.png`, without the flags in `skip`.
fn qwen_gen(d: &Path, skip: &[&str]) -> Vec<OsString> {
    let mut v: Vec<OsString> = Vec::new();
    for (flag, file) in [
        ("--diffusion-model", "qwen_dit"),
        ("--llm", "qwen_llm"),
        ("--vae", "qwen_vae"),
    ] {
        if !skip.contains(&flag) {
            v.push(flag.into());
            v.push(d.join(format!("{file}.safetensors")).into());
        }
    }
    for a in [
        "-p",
        "a cat",
        "-n",
        "blurry",
        "-W",
        "32",
        "-H",
        "32",
        "--steps",
        "2",
        "--cfg-scale",
        "2.5",
        "-t",
        "2",
        "-o",
    ] {
        v.push(a.into());
    }
    v.push(d.join("o.png").into());
    v
}

/// Arguments of a 2-step 32x32 SD3.5 generation ("a red fox", negative "blurry", 2
/// threads) writing `d/<out>`, the model given by `model` (flags and files in `d`).
fn sd3_gen(d: &Path, model: &[&str], out: &str) -> Vec<OsString> {
    let mut v: Vec<OsString> = Vec::new();
    for (i, a) in model.iter().enumerate() {
        v.push(if i % 2 == 1 {
            d.join(a).into_os_string()
        } else {
            a.into()
        });
    }
    for a in [
        "-p",
        "a red fox",
        "-n",
        "blurry",
        "-W",
        "32",
        "-H",
        "32",
        "--steps",
        "2",
        "-t",
        "2",
    ] {
        v.push(a.into());
    }
    v.push("-o".into());
    v.push(d.join(out).into());
    v
}

/// The split SD3.5 components as flags.
const SD3_PARTS: &[&str] = &[
    "--diffusion-model",
    "dit.safetensors",
    "--clip_l",
    "l.safetensors",
    "--clip_g",
    "g.safetensors",
    "--t5xxl",
    "t5.safetensors",
    "--vae",
    "vae.safetensors",
];

const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";

/// Arguments of a quick generation writing `out`.
fn gen(out: impl AsRef<OsStr>) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec!["-m".into(), model().into()];
    for a in [
        "-p",
        "a red circle",
        "--steps",
        "1",
        "-W",
        "64",
        "-H",
        "64",
        "-t",
        "2",
    ] {
        v.push(a.into());
    }
    v.push("-o".into());
    v.push(out.as_ref().to_owned());
    v
}

/// [`gen`] with a prompt the built-in model was trained on (a picture that small weight
/// changes move by a few levels: an unknown prompt's one step amplifies them) and
/// `--type weights`.
fn bf16_case(out: impl AsRef<OsStr>, weights: &str) -> Vec<OsString> {
    let mut v = gen(out);
    v[3] = "a red circle on a white background".into();
    with(v, &["--type", weights])
}

/// The check of a [`bf16_case`] run with other weights than f16 into `d/o.png`: the same
/// case with f16 weights (into `d/f16.png`) gives a different image (other weights ran) of
/// the same picture, within a few levels (measured with bf16: max 8, mean 0.67 levels).
fn near_the_f16_image(d: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_sd"))
        .args(bf16_case(d.join("f16.png"), "f16"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
    let (a, b) = (img(&d.join("o.png")), img(&d.join("f16.png")));
    assert_eq!(a.len(), b.len());
    let diff: Vec<u32> = a
        .iter()
        .zip(&b)
        .map(|(p, q)| p.abs_diff(*q) as u32)
        .collect();
    let max = diff.iter().max().copied().unwrap_or(0);
    let mean = diff.iter().sum::<u32>() as f64 / diff.len() as f64;
    assert!(
        max > 0 && max <= 32 && mean <= 2.0,
        "max {max}, mean {mean}"
    );
}

fn with(mut v: Vec<OsString>, extra: &[&str]) -> Vec<OsString> {
    v.extend(extra.iter().map(OsString::from));
    v
}

/// One case.
struct Case {
    name: &'static str,
    /// Prepares the directory (files, links, FIFOs).
    setup: fn(&Path),
    /// The arguments, given the directory.
    args: fn(&Path) -> Vec<OsString>,
    /// The exit code.
    code: i32,
    /// Words that must all be in stderr.
    stderr: &'static [&'static str],
    /// Words that must all be in stdout.
    stdout: &'static [&'static str],
    /// The file names in the directory afterwards (sorted).
    files: &'static [&'static str],
    /// Further checks.
    check: fn(&Path, &Output),
}

fn none(_: &Path) {}
fn no_check(_: &Path, _: &Output) {}

/// A file a case's `setup` may write: `NAME=VALUE` lines the runner sets in `sd`'s
/// environment (the runner removes the file before `sd` runs).
const ENV_FILE: &str = "sd.env";

/// Setup of the cases that compare a run with models on the CPU to the all-device run bit for
/// bit: ggml's ops on the CPU (`SD_HOST_KERNELS=0`), the simulated device's bits (the
/// project's CPU attention kernel rounds otherwise; `cli.rs` covers it).
fn ggml_ops_on_the_cpu(d: &Path) {
    std::fs::write(d.join(ENV_FILE), "SD_HOST_KERNELS=0\n").unwrap();
}

fn is_png(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| b.starts_with(PNG))
}

/// The simulated device's peak in a `-v` run's stderr, in bytes.
fn sim_peak(stderr: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(stderr);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("simulated device peak: "))
        .unwrap_or_else(|| panic!("no simulated device peak in\n{text}"));
    let mib: f64 = line.trim_end_matches(" MiB").parse().unwrap();
    (mib * (1u64 << 20) as f64) as u64
}

/// Checks a run of [`gen`] with some models moved to the CPU (`o`, `d/o.png`) against the
/// same run with every model on `sim:64` under `--max-vram max_vram`: the same pixels
/// (the CPU and the simulated device run the same ggml CPU kernels with exact numerics),
/// and the simulated device's peak within the budget and no larger than the all-device
/// run's (the models on the CPU hold nothing there).
fn same_as_on_sim(d: &Path, o: &Output, max_vram: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_sd"))
        .args(with(
            gen(d.join("all.png")),
            &["--backend", "sim:64", "--max-vram", max_vram, "-v"],
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
    assert!(
        img(&d.join("o.png")) == img(&d.join("all.png")),
        "pixels differ"
    );
    std::fs::remove_file(d.join("all.png")).unwrap();
    let budget = sd_residency::capacity::parse_size(max_vram, 20).unwrap();
    let (placed, all) = (sim_peak(&o.stderr), sim_peak(&out.stderr));
    // `-v` prints the peak in MiB to two decimals: allow its rounding.
    assert!(placed <= budget + (6 << 10), "peak {placed} over {budget}");
    assert!(
        placed <= all + (6 << 10),
        "peak {placed} above the all-device {all}"
    );
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "--refiner: the SDXL refiner takes over at --refiner-start",
            setup: none,
            args: |d| {
                let mut v = sdxl_gen(d.join("o.png"));
                v.push("--refiner".into());
                v.push(sdxl_fixture("tiny_sdxl_refiner.safetensors").into());
                with(v, &["--refiner-start", "0.5"])
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| {
                // The base alone draws another image.
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(sdxl_gen(d.join("base.png")))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) != img(&d.join("base.png")));
            },
        },
        Case {
            name: "-m a diffusers pipeline folder: same image as the single file",
            setup: none,
            args: |d| {
                let mut v = sdxl_gen(d.join("o.png"));
                v[1] = sdxl_fixture("tiny_sdxl_diffusers").into();
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| {
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(sdxl_gen(d.join("file.png")))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) == img(&d.join("file.png")));
            },
        },
        Case {
            name: "--hires: 64x64 first pass, 128x128 second (Latent, scale 2)",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--hires"]),
            code: 0,
            stderr: &[],
            stdout: &["saved", "128x128"],
            files: &["o.png"],
            check: |d, _| {
                let img = sd_tensor::Image::load_png(d.join("o.png")).unwrap();
                assert_eq!((img.width(), img.height()), (128, 128));
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                let text = String::from_utf8_lossy(&bytes);
                assert!(
                    text.contains("Hires resize: 128x128")
                        && text.contains("Hires upscaler: Latent"),
                    "parameters text"
                );
            },
        },
        Case {
            name: "--hires with an upscaler model and explicit size",
            setup: none,
            args: |d| {
                let mut v = with(
                    gen(d.join("o.png")),
                    &[
                        "--hires",
                        "--hires-width",
                        "128",
                        "--hires-height",
                        "96",
                        "--hires-steps",
                        "2",
                        "--hires-denoising-strength",
                        "0.5",
                        "--hires-upscale-tile-size",
                        "32",
                        "--hires-upscaler",
                    ],
                );
                v.push(upscaler().into());
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["saved", "128x96"],
            files: &["o.png"],
            check: |d, _| {
                let img = sd_tensor::Image::load_png(d.join("o.png")).unwrap();
                assert_eq!((img.width(), img.height()), (128, 96));
            },
        },
        Case {
            name: "--hires-scale without --hires: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--hires-scale", "1.5"]),
            code: 2,
            stderr: &["--hires-scale", "needs --hires"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--hires-upscaler Lanczos: PIL's Lanczos on the decoded image",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &[
                        "--hires",
                        "--hires-steps",
                        "2",
                        "--hires-upscaler",
                        "Lanczos",
                    ],
                )
            },
            code: 0,
            stderr: &[],
            stdout: &["saved", "128x128"],
            files: &["o.png"],
            check: |d, _| {
                let img = sd_tensor::Image::load_png(d.join("o.png")).unwrap();
                assert_eq!((img.width(), img.height()), (128, 128));
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                let text = String::from_utf8_lossy(&bytes);
                assert!(text.contains("Hires upscaler: Lanczos"), "parameters text");
            },
        },
        Case {
            name: "--hires-upscaler \"Latent (bicubic antialiased)\" runs",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &[
                        "--hires",
                        "--hires-steps",
                        "1",
                        "--hires-upscaler",
                        "Latent (bicubic antialiased)",
                    ],
                )
            },
            code: 0,
            stderr: &[],
            stdout: &["saved", "128x128"],
            files: &["o.png"],
            check: no_check,
        },
        Case {
            name: "--hires-upscaler neither built in nor a file: exit 2 listing the built-ins",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--hires", "--hires-upscaler", "Latent (sharp)"],
                )
            },
            code: 2,
            stderr: &["--hires-upscaler", "Latent (sharp)", "\"Lanczos\"", "does not exist"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--hires-upscale-tile-size with a built-in resize: exit 2",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--hires", "--hires-upscale-tile-size", "64"],
                )
            },
            code: 2,
            stderr: &["--hires-upscale-tile-size", "Latent"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--hires-upscale-tile-size without --hires: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--hires-upscale-tile-size", "64"]),
            code: 2,
            stderr: &["--hires-upscale-tile-size", "needs --hires"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--hires-width not a multiple of the size step: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--hires", "--hires-width", "100"]),
            code: 2,
            stderr: &["--hires-width", "100", "multiple"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--refiner-start without --refiner: exit 2",
            setup: none,
            args: |d| with(sdxl_gen(d.join("o.png")), &["--refiner-start", "0.5"]),
            code: 2,
            stderr: &["--refiner-start", "--refiner"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--refiner-start outside (0, 1): exit 2",
            setup: none,
            args: |d| {
                let mut v = sdxl_gen(d.join("o.png"));
                v.push("--refiner".into());
                v.push(sdxl_fixture("tiny_sdxl_refiner.safetensors").into());
                with(v, &["--refiner-start", "1"])
            },
            code: 2,
            stderr: &["--refiner-start", "between 0 and 1"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "an SDXL refiner as -m: exit 2 naming --refiner",
            setup: none,
            args: |d| {
                let mut v = sdxl_gen(d.join("o.png"));
                v[1] = sdxl_fixture("tiny_sdxl_refiner.safetensors").into();
                v
            },
            code: 2,
            stderr: &["refiner", "--refiner", "-m"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--refiner with a missing file: names it",
            setup: none,
            args: |d| {
                let mut v = sdxl_gen(d.join("o.png"));
                v.push("--refiner".into());
                v.push(sdxl_fixture("no_such_refiner.safetensors").into());
                v
            },
            code: 1,
            stderr: &["no_such_refiner.safetensors"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "no arguments: usage, exit 2",
            setup: none,
            args: |_| vec![],
            code: 2,
            stderr: &["Usage:", "sd --help"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "unknown flag: one line and a hint",
            setup: none,
            args: |_| vec!["--no-such-flag".into()],
            code: 2,
            stderr: &["error:", "--no-such-flag", "hint:"],
            stdout: &[],
            files: &[],
            check: |_, o| {
                let lines = String::from_utf8_lossy(&o.stderr).lines().count();
                assert!(lines <= 3, "{lines} lines");
            },
        },
        Case {
            name: "bad value: names the flag",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--sampling-method", "nope"]),
            code: 2,
            stderr: &["--sampling-method", "euler_a"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "sd.cpp flag not supported yet",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--control-net", "cn.safetensors"]),
            code: 2,
            stderr: &["--control-net", "does not support yet"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "-M convert not supported yet",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-M", "convert"]),
            code: 2,
            stderr: &["convert", "not supported yet"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "FLUX.1-dev through sd: 3 steps, guidance 3.5, cfg 1 (the model's defaults)",
            setup: flux_setup,
            args: |d| flux_gen(d, "o.png", &["--steps", "3"]),
            code: 0,
            stderr: &[],
            stdout: &["saved", "32x32"],
            files: &["flux.safetensors", "o.png"],
            check: |d, _| {
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                let text = String::from_utf8_lossy(&bytes);
                assert!(text.contains("CFG scale: 1"), "parameters text");
            },
        },
        Case {
            name: "FLUX.1 under --max-vram 12M on a simulated GPU: the unbudgeted image",
            setup: flux_setup,
            args: |d| {
                flux_gen(
                    d,
                    "o.png",
                    &["--steps", "2", "--backend", "sim:64", "--max-vram", "12M"],
                )
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["flux.safetensors", "o.png"],
            check: |d, _| {
                let v = flux_gen(d, "whole.png", &["--steps", "2", "--backend", "sim:64"]);
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(v)
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) == img(&d.join("whole.png")));
            },
        },
        Case {
            name: "SD3.5 through sd: one file with its encoders, CFG 7 (the model's default)",
            setup: sd3_setup,
            args: |d| sd3_gen(d, &["-m", "sd3.safetensors"], "o.png"),
            code: 0,
            stderr: &[],
            stdout: &["saved", "32x32"],
            files: &["o.png", "sd3.safetensors"],
            check: |d, _| {
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                let text = String::from_utf8_lossy(&bytes);
                assert!(text.contains("CFG scale: 7"), "parameters text");
            },
        },
        Case {
            name: "Qwen-Image from its parts (--diffusion-model, --llm, --vae; bare names): an image",
            setup: qwen_parts,
            args: |d| qwen_gen(d, &[]),
            code: 0,
            stderr: &[],
            stdout: &["saved", "32x32"],
            files: &[
                "o.png",
                "qwen_dit.safetensors",
                "qwen_llm.safetensors",
                "qwen_vae.safetensors",
            ],
            check: |d, _| {
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                let text = String::from_utf8_lossy(&bytes);
                assert!(text.contains("CFG scale: 2.5"), "parameters text");
            },
        },
        Case {
            name: "Qwen-Image without --llm: the error names the flag, nothing written",
            setup: qwen_parts,
            args: |d| qwen_gen(d, &["--llm"]),
            code: 1,
            stderr: &["--llm"],
            stdout: &[],
            files: &[
                "qwen_dit.safetensors",
                "qwen_llm.safetensors",
                "qwen_vae.safetensors",
            ],
            check: |_, _| {},
        },
        Case {
            name: "Qwen-Image with a CLIP file as --llm: the error names the file, the kind and the flag",
            setup: qwen_parts_clip_as_llm,
            args: |d| qwen_gen(d, &[]),
            code: 1,
            stderr: &["qwen_llm.safetensors", "CLIP", "--llm"],
            stdout: &[],
            files: &[
                "qwen_dit.safetensors",
                "qwen_llm.safetensors",
                "qwen_vae.safetensors",
            ],
            check: |_, _| {},
        },
        Case {
            name: "SD3.5 from separate files (--diffusion-model, --clip_l, --clip_g, --t5xxl, --vae): the single file's image",
            setup: sd3_components,
            args: |d| sd3_gen(d, SD3_PARTS, "o.png"),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &[
                "dit.safetensors",
                "g.safetensors",
                "l.safetensors",
                "o.png",
                "sd3.safetensors",
                "t5.safetensors",
                "vae.safetensors",
            ],
            check: |d, _| {
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(sd3_gen(d, &["-m", "sd3.safetensors"], "one.png"))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) == img(&d.join("one.png")));
            },
        },
        Case {
            name: "--diffusion-model with bare transformer names (Stability's, city96's files): the single file's image",
            setup: |d| {
                sd3_components(d);
                files::strip(
                    &d.join("sd3.safetensors"),
                    "model.diffusion_model.",
                    &d.join("bare.safetensors"),
                );
            },
            args: |d| {
                let mut parts = SD3_PARTS.to_vec();
                parts[1] = "bare.safetensors";
                sd3_gen(d, &parts, "o.png")
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &[
                "bare.safetensors",
                "dit.safetensors",
                "g.safetensors",
                "l.safetensors",
                "o.png",
                "sd3.safetensors",
                "t5.safetensors",
                "vae.safetensors",
            ],
            check: |d, _| {
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(sd3_gen(d, &["-m", "sd3.safetensors"], "one.png"))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) == img(&d.join("one.png")));
            },
        },
        Case {
            name: "SD3.5 with skip-layer guidance (--slg-scale, --skip-layers, --skip-layer-end): another image",
            setup: sd3_setup,
            args: |d| {
                let mut v = sd3_gen(d, &["-m", "sd3.safetensors"], "o.png");
                for a in [
                    "--steps",
                    "4",
                    "--slg-scale",
                    "2.5",
                    "--skip-layers",
                    "[0]",
                    "--skip-layer-end",
                    "0.9",
                ] {
                    v.push(a.into());
                }
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png", "sd3.safetensors"],
            check: |d, _| {
                let mut v = sd3_gen(d, &["-m", "sd3.safetensors"], "plain.png");
                v.push("--steps".into());
                v.push("4".into());
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(v)
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) != img(&d.join("plain.png")));
            },
        },
        Case {
            name: "--flow-shift 1 with SD3.5 (unshifted sigmas): another image than its default 3",
            setup: sd3_setup,
            args: |d| {
                let mut v = sd3_gen(d, &["-m", "sd3.safetensors"], "o.png");
                v.push("--flow-shift".into());
                v.push("1".into());
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png", "sd3.safetensors"],
            check: |d, _| {
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(sd3_gen(d, &["-m", "sd3.safetensors"], "default.png"))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) != img(&d.join("default.png")));
            },
        },
        Case {
            name: "--flow-shift with an SD1 model: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--flow-shift", "3"]),
            code: 2,
            stderr: &["flow-shift", "not a flow model"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--skip-layers past the model's blocks: exit 2 naming the block",
            setup: sd3_setup,
            args: |d| {
                let mut v = sd3_gen(d, &["-m", "sd3.safetensors"], "o.png");
                for a in ["--slg-scale", "2.5", "--skip-layers", "[7,8,9]"] {
                    v.push(a.into());
                }
                v
            },
            code: 2,
            stderr: &["skip-layers", "block 7", "2 joint blocks"],
            stdout: &[],
            files: &["sd3.safetensors"],
            check: no_check,
        },
        Case {
            name: "--slg-scale with an SD1 model: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--slg-scale", "2.5"]),
            code: 2,
            stderr: &["slg-scale", "SD3"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--skip-layers without --slg-scale: exit 2",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--skip-layers", "[1]"]),
            code: 2,
            stderr: &["--slg-scale"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "SD3.5 without --clip_g: names the missing encoder's flag",
            setup: sd3_components,
            args: |d| {
                let parts: Vec<&str> = SD3_PARTS
                    .chunks(2)
                    .filter(|p| p[0] != "--clip_g")
                    .flatten()
                    .copied()
                    .collect();
                sd3_gen(d, &parts, "o.png")
            },
            code: 1,
            stderr: &["bigG", "--clip_g"],
            stdout: &[],
            files: &[
                "dit.safetensors",
                "g.safetensors",
                "l.safetensors",
                "sd3.safetensors",
                "t5.safetensors",
                "vae.safetensors",
            ],
            check: no_check,
        },
        Case {
            name: "an SD3.5 transformer file alone: names the missing encoders' flags",
            setup: none,
            args: |d| {
                let mut v: Vec<OsString> = vec![
                    "-m".into(),
                    sdxl_fixture("../../../../sd-models/tests/fixtures/sd3/sd35_tiny.safetensors")
                        .into(),
                ];
                for a in ["-p", "a fox", "--steps", "2", "-W", "32", "-H", "32"] {
                    v.push(a.into());
                }
                v.push("-o".into());
                v.push(d.join("o.png").into());
                v
            },
            code: 1,
            stderr: &["sd35_tiny.safetensors", "CLIP-L", "--clip_l"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--t5xxl with an SD1 model: names the flag and the family",
            setup: none,
            args: |d| {
                let mut v = gen(d.join("o.png"));
                v.push("--t5xxl".into());
                v.push(sdxl_fixture("../t5/t5_deep.safetensors").into());
                v
            },
            code: 1,
            stderr: &["--t5xxl", "not a component"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "a FLUX.1 transformer file alone: names the missing encoders' flags",
            setup: none,
            args: |d| {
                let mut v: Vec<OsString> = vec![
                    "-m".into(),
                    sdxl_fixture("../../../../sd-models/tests/fixtures/flux/flux_tiny.safetensors")
                        .into(),
                ];
                for a in ["-p", "a fox", "--steps", "2", "-W", "32", "-H", "32"] {
                    v.push(a.into());
                }
                v.push("-o".into());
                v.push(d.join("o.png").into());
                v
            },
            code: 1,
            stderr: &["flux_tiny.safetensors", "CLIP-L", "--clip_l"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "FLUX.1 with true CFG (--cfg-scale 3 and a negative prompt): another image",
            setup: flux_setup,
            args: |d| {
                flux_gen(
                    d,
                    "o.png",
                    &["--steps", "2", "--cfg-scale", "3", "-n", "blurry"],
                )
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["flux.safetensors", "o.png"],
            check: |d, _| {
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(flux_gen(d, "plain.png", &["--steps", "2"]))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) != img(&d.join("plain.png")));
                let bytes = std::fs::read(d.join("o.png")).unwrap();
                assert!(String::from_utf8_lossy(&bytes).contains("CFG scale: 3"));
            },
        },
        Case {
            name: "FLUX.1 with lcm (re-noised the flow way) runs",
            setup: flux_setup,
            args: |d| flux_gen(d, "o.png", &["--steps", "2", "--sampling-method", "lcm"]),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["flux.safetensors", "o.png"],
            check: no_check,
        },
        Case {
            name: "FLUX.1 with dpm++2s_a (no flow form yet): refused by name",
            setup: flux_setup,
            args: |d| {
                flux_gen(
                    d,
                    "o.png",
                    &["--steps", "2", "--sampling-method", "dpm++2s_a"],
                )
            },
            code: 2,
            stderr: &["dpm++2s_a", "flow model"],
            stdout: &[],
            files: &["flux.safetensors"],
            check: no_check,
        },
        Case {
            name: "--rng std_default (libstdc++'s engine) runs; the default is cuda",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--rng", "std_default"]),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| {
                // Another noise than the default (cuda) and than cpu.
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                let mut others = Vec::new();
                for (name, rng) in [("cuda.png", None), ("cpu.png", Some("cpu"))] {
                    let mut args = gen(d.join(name));
                    if let Some(r) = rng {
                        args = with(args, &["--rng", r]);
                    }
                    let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                        .args(args)
                        .output()
                        .unwrap();
                    assert!(out.status.success());
                    others.push(img(&d.join(name)));
                }
                let std = img(&d.join("o.png"));
                assert!(
                    others.iter().all(|o| *o != std),
                    "std_default = cuda or cpu"
                );
                // The default is cuda: the same as --rng cuda.
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(with(gen(d.join("explicit.png")), &["--rng", "cuda"]))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                assert!(img(&d.join("explicit.png")) == others[0]);
            },
        },
        Case {
            name: "--vae-on-cpu on a simulated GPU: the all-device image",
            setup: ggml_ops_on_the_cpu,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:64", "--max-vram", "8M", "--vae-on-cpu", "-v"],
                )
            },
            code: 0,
            stderr: &["simulated device peak"],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, o| same_as_on_sim(d, o, "8M"),
        },
        Case {
            name: "--clip-on-cpu on a simulated GPU: the all-device image",
            setup: ggml_ops_on_the_cpu,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:64", "--max-vram", "8M", "--clip-on-cpu", "-v"],
                )
            },
            code: 0,
            stderr: &["simulated device peak"],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, o| same_as_on_sim(d, o, "8M"),
        },
        Case {
            name: "--backend te=cpu,vae=cpu,diffusion=sim:64: the all-device image",
            setup: ggml_ops_on_the_cpu,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &[
                        "--backend",
                        "te=cpu,vae=cpu,diffusion=sim:64",
                        "--max-vram",
                        "8M",
                        "-v",
                    ],
                )
            },
            code: 0,
            stderr: &["simulated device peak"],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, o| same_as_on_sim(d, o, "8M"),
        },
        Case {
            name: "a layer split on the VAE (--backend vae=cpu&sim:64): exit 2, nothing written",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--backend", "vae=cpu&sim:64,diffusion=sim:64"],
                )
            },
            code: 2,
            stderr: &["--backend", "vae", "layer split is for the diffusion model"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "sd plan --vae-on-cpu on a simulated GPU: the VAE on the CPU, outside the budget",
            setup: none,
            args: |d| {
                let mut v = vec!["plan".into()];
                v.extend(with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:256", "--max-vram", "8M", "--vae-on-cpu"],
                ));
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["vae decode", "budget 8.00 MiB"],
            files: &[],
            check: |d, o| {
                let table = String::from_utf8_lossy(&o.stdout);
                let row = |name: &str| {
                    table
                        .lines()
                        .find(|l| l.starts_with(name))
                        .unwrap_or_else(|| panic!("no row {name} in\n{table}"))
                        .to_string()
                };
                assert!(row("vae decode").ends_with(" CPU"), "{table}");
                assert!(row("diffusion").ends_with(" SIM0"), "{table}");
                assert!(row("text encoder 0").ends_with(" SIM0"), "{table}");
                // The JSON says the same, and the VAE's plan has no limit.
                let mut v: Vec<OsString> = vec!["plan".into(), "--json".into()];
                v.extend(with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:256", "--max-vram", "8M", "--vae-on-cpu"],
                ));
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(v)
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                let models = j["models"].as_array().unwrap();
                let vae = models.iter().find(|m| m["model"] == "vae decode").unwrap();
                assert_eq!(vae["on"], "CPU");
                // Planned against host memory, not the device budget.
                assert!(vae["limit"].as_u64().is_none_or(|l| l > 8 << 20), "{vae}");
                assert_eq!(vae["moved_per_run"], 0);
                let unet = models.iter().find(|m| m["model"] == "diffusion").unwrap();
                assert_eq!(unet["on"], "SIM0");
                assert_eq!(unet["limit"], 8u64 << 20);
            },
        },
        Case {
            name: "non-UTF-8 prompt",
            setup: none,
            args: |d| {
                let mut v = gen(d.join("o.png"));
                v.push("-p".into());
                v.push(OsStr::from_bytes(b"a \xff circle").to_owned());
                v
            },
            code: 2,
            stderr: &["UTF-8"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "huge size refused at parse time",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-W", "100000", "-H", "100000"]),
            code: 2,
            stderr: &["--width", "100000"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "size beyond memory refused before the steps",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-W", "16384", "-H", "16384"]),
            code: 2,
            stderr: &["16384x16384", "GiB"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "size beyond the device's memory refused before loading (sim device)",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["-W", "2048", "-H", "2048", "--backend", "sim:64"],
                )
            },
            code: 2,
            stderr: &["2048x2048", "SIM0", "attention scores", "--diffusion-fa"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "the device preflight counts --max-vram, not only the device",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &[
                        "-W",
                        "512",
                        "-H",
                        "512",
                        "--backend",
                        "sim:2048",
                        "--max-vram",
                        "64M",
                    ],
                )
            },
            code: 2,
            stderr: &[
                "512x512",
                "SIM0 within its --max-vram budget",
                "64.0 MiB are available",
            ],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "sd plan --refiner: the refiner's encoder and network after the base's",
            setup: none,
            args: |d| {
                let mut v: Vec<OsString> = vec!["plan".into()];
                v.extend(sdxl_gen(d.join("o.png")));
                v.push("--refiner".into());
                v.push(sdxl_fixture("tiny_sdxl_refiner.safetensors").into());
                with(v, &["--backend", "sim:256", "--max-vram", "64M"])
            },
            code: 0,
            stderr: &[],
            stdout: &["diffusion", "refiner text encoder 0", "refiner diffusion", "vae decode"],
            files: &[],
            check: no_check,
        },
        Case {
            name: "a device that rounds buffers up to 2 MiB pages: the budget counts the pages",
            setup: none,
            // Counted at exact sizes, as before, this run went ahead under 12M and its many
            // small buffers, each a whole page on this device, peaked at 36 MiB.
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:128/2M", "--max-vram", "12M"],
                )
            },
            code: 1,
            stderr: &["does not fit a limit of 12582912 B on SIM0", "minimum budget"],
            stdout: &[],
            files: &[],
            check: |d, _| {
                // Under a budget that holds the pages: within it, the unbudgeted image.
                let run = |name: &str, extra: &[&str]| {
                    let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                        .args(with(gen(d.join(name)), extra))
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                    out
                };
                let o = run("o.png", &["--backend", "sim:128/2M", "--max-vram", "40M", "-v"]);
                let peak = sim_peak(&o.stderr);
                assert!(peak <= (40 << 20) + (6 << 10), "peak {peak} over 40M");
                run("whole.png", &["--backend", "sim:128"]);
                let img = |p: &Path| sd_tensor::Image::load_png(p).unwrap().into_pixels();
                assert!(img(&d.join("o.png")) == img(&d.join("whole.png")), "pixels differ");
            },
        },
        Case {
            name: "sd plan: the run's segments on the simulated device, nothing written",
            setup: none,
            args: |d| {
                let mut v = vec!["plan".into()];
                v.extend(with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:256", "--max-vram", "8M", "--steps", "20"],
                ));
                v
            },
            code: 0,
            stderr: &[],
            stdout: &[
                "plan: 64x64, 20 steps",
                "text encoder 0",
                "diffusion",
                "16x16 latents, batch 2",
                "vae decode",
                "segments",
                "per step:",
                "budget 8.00 MiB",
            ],
            files: &[],
            check: no_check,
        },
        Case {
            name: "sd plan --json: what does not fit, and the minimum budget",
            setup: none,
            args: |d| {
                let mut v = vec!["plan".into(), "--json".into()];
                v.extend(with(
                    gen(d.join("o.png")),
                    &["--backend", "sim:256", "--max-vram", "256K"],
                ));
                v
            },
            code: 1,
            stderr: &["does not fit"],
            stdout: &["\"fits\": false"],
            files: &[],
            check: |_, o| {
                let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                let models = v["models"].as_array().unwrap();
                let unet = models.iter().find(|m| m["model"] == "diffusion").unwrap();
                assert_eq!(unet["fits"], false);
                let min = unet["minimum"].as_u64().unwrap();
                assert!(min > 256 << 10, "{min}");
                assert!(v["minimum"].as_u64().unwrap() >= min);
                assert!(unet["shortfall"]["segment"].is_string());
            },
        },
        Case {
            name: "-M plan on the CPU: whole graphs, nothing moved",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-M", "plan", "--json"]),
            code: 0,
            stderr: &[],
            stdout: &["\"fits\": true"],
            files: &[],
            check: |_, o| {
                let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                assert_eq!(v["moved_per_image"], 0);
                for m in v["models"].as_array().unwrap() {
                    assert_eq!(m["segments"].as_array().unwrap().len(), 1, "{m}");
                }
            },
        },
        Case {
            name: "--json outside plan mode",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--json"]),
            code: 2,
            stderr: &["--json", "plan"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "huge steps",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--steps", "1000000000"]),
            code: 2,
            stderr: &["--steps"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "huge threads",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-t", "100000"]),
            code: 2,
            stderr: &["--threads"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "huge upscale repeats",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--upscale-repeats", "6"]),
            code: 2,
            stderr: &["--upscale-repeats"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "--type bf16: bf16 weights (bf16 products on the CPU), f16's image within a few levels",
            setup: none,
            args: |d| bf16_case(d.join("o.png"), "bf16"),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| near_the_f16_image(d),
        },
        Case {
            name: "--type q8_0: q8_0 linear weights (on AMX tiles, the kernels in bf16, where the CPU has them), f16's image within a few levels",
            setup: none,
            args: |d| bf16_case(d.join("o.png"), "q8_0"),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| near_the_f16_image(d),
        },
        Case {
            name: "LoRA tag without --lora-model-dir",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-p", "a circle <lora:x:0.5>"]),
            code: 2,
            stderr: &["--lora-model-dir"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "LoRA file missing: exit 1 naming it",
            setup: none,
            args: |d| {
                let mut v = with(gen(d.join("o.png")), &["-p", "a circle <lora:nope:0.5>"]);
                v.push("--lora-model-dir".into());
                v.push(d.into());
                v
            },
            code: 1,
            stderr: &["LoRA 'nope'"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "LoRA whose target is missing: exit 1 naming the tensor",
            setup: |d| write_lora(&d.join("bad.safetensors"), "lora_unet_no_such_layer"),
            args: |d| {
                let mut v = with(gen(d.join("o.png")), &["-p", "a circle <lora:bad:1>"]);
                v.push("--lora-model-dir".into());
                v.push(d.into());
                v
            },
            code: 1,
            stderr: &["bad.safetensors", "no_such_layer"],
            stdout: &[],
            files: &["bad.safetensors"],
            check: no_check,
        },
        Case {
            name: "--lora-apply-mode at_runtime: exit 2 saying why",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["--lora-apply-mode", "at_runtime"]),
            code: 2,
            stderr: &["--lora-apply-mode", "at_runtime", "not supported"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "LoRA tag applied (kohya keys), stripped from the prompt",
            setup: |d| write_lora(&d.join("style.safetensors"), "lora_unet_out_2"),
            args: |d| {
                let mut v = with(
                    gen(d.join("o.png")),
                    &[
                        "-p",
                        "a red circle <lora:style:0.7>",
                        "-v",
                        "--lora-apply-mode",
                        "immediately",
                    ],
                );
                v.push("--lora-model-dir".into());
                v.push(d.into());
                v
            },
            code: 0,
            stderr: &["LoRA", "style.safetensors"],
            stdout: &["saved"],
            files: &["o.png", "style.safetensors"],
            check: |d, _| {
                let (_, text) = sd_tensor::Image::load_png_with_text(d.join("o.png")).unwrap();
                let params = &text.iter().find(|(k, _)| k == "parameters").unwrap().1;
                assert!(params.starts_with("a red circle \nSteps"), "{params}");
                // The same run without the LoRA gives other pixels.
                let base = d.join("base.png");
                let mut args = gen(&base);
                args[3] = "a red circle ".into();
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(args)
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let a = sd_tensor::Image::load_png(d.join("o.png")).unwrap();
                let b = sd_tensor::Image::load_png(&base).unwrap();
                assert!(a.pixels() != b.pixels(), "the LoRA changed nothing");
            },
        },
        Case {
            name: "-o x.jpg writes JPEG with the parameters in EXIF",
            setup: none,
            args: |d| gen(d.join("o.jpg")),
            code: 0,
            stderr: &[],
            stdout: &["saved", "o.jpg"],
            files: &["o.jpg"],
            check: |d, _| {
                let bytes = std::fs::read(d.join("o.jpg")).unwrap();
                assert_eq!(&bytes[..3], &[0xff, 0xd8, 0xff]);
                let mut dec = zune_jpeg::JpegDecoder::new(std::io::Cursor::new(&bytes));
                dec.decode().unwrap();
                assert_eq!(dec.dimensions(), Some((64, 64)));
                assert!(exif_text(&bytes).contains("a red circle\nSteps: 1"));
            },
        },
        Case {
            name: "-o x.JPEG and x.webp: JPEG and lossless WebP, as the PNG's pixels",
            setup: none,
            args: |d| gen(d.join("o.webp")),
            code: 0,
            stderr: &[],
            stdout: &["saved", "o.webp"],
            files: &["o.webp"],
            check: |d, _| {
                let bytes = std::fs::read(d.join("o.webp")).unwrap();
                assert!(bytes.starts_with(b"RIFF") && &bytes[8..12] == b"WEBP");
                assert!(exif_text(&bytes).contains("a red circle\nSteps: 1"));
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(gen(d.join("o.png")))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let png = sd_tensor::Image::load_png(d.join("o.png")).unwrap();
                let mut dec = image_webp::WebPDecoder::new(std::io::Cursor::new(&bytes)).unwrap();
                let mut px = vec![0u8; dec.output_buffer_size().unwrap()];
                dec.read_image(&mut px).unwrap();
                assert!(px == png.pixels(), "WebP is not lossless");
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(gen(d.join("o.JPEG")))
                    .output()
                    .unwrap();
                assert!(out.status.success());
                let jpg = std::fs::read(d.join("o.JPEG")).unwrap();
                assert_eq!(&jpg[..2], &[0xff, 0xd8]);
            },
        },
        Case {
            name: "another extension refused before any work",
            setup: none,
            args: |d| gen(d.join("o.gif")),
            code: 2,
            stderr: &["-o/--output", "o.gif", ".png, .jpg, .jpeg or .webp"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "file name too long",
            setup: none,
            args: |d| gen(d.join("a".repeat(300) + ".png")),
            code: 2,
            stderr: &["-o/--output", "255"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "output directory missing",
            setup: none,
            args: |d| gen(d.join("missing/o.png")),
            code: 2,
            stderr: &["-o/--output", "does not exist"],
            stdout: &[],
            files: &[],
            check: no_check,
        },
        Case {
            name: "NaN weights: exit 1, no image",
            setup: |d| write_nan_model(&d.join("nan.safetensors")),
            args: |d| {
                let mut v = gen(d.join("o.png"));
                v[1] = d.join("nan.safetensors").into();
                v
            },
            code: 1,
            stderr: &["NaN or infinite"],
            stdout: &[],
            files: &["nan.safetensors"],
            check: no_check,
        },
        Case {
            name: "symlinks at the output and the old temporary name are not followed",
            setup: |d| {
                std::fs::write(d.join("victim"), b"keep").unwrap();
                std::fs::write(d.join("target"), b"keep").unwrap();
                std::os::unix::fs::symlink(d.join("victim"), d.join("o.png.tmp")).unwrap();
                std::os::unix::fs::symlink(d.join("target"), d.join("o.png")).unwrap();
            },
            args: |d| gen(d.join("o.png")),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png", "o.png.tmp", "target", "victim"],
            check: |d, _| {
                assert_eq!(std::fs::read(d.join("victim")).unwrap(), b"keep");
                assert_eq!(std::fs::read(d.join("target")).unwrap(), b"keep");
                let m = std::fs::symlink_metadata(d.join("o.png")).unwrap();
                assert!(m.file_type().is_file());
                assert!(is_png(&d.join("o.png")));
            },
        },
        Case {
            name: "an existing output keeps its mode",
            setup: |d| {
                std::fs::write(d.join("o.png"), b"old").unwrap();
                let p = std::fs::Permissions::from_mode(0o640);
                std::fs::set_permissions(d.join("o.png"), p).unwrap();
            },
            args: |d| gen(d.join("o.png")),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["o.png"],
            check: |d, _| {
                let m = std::fs::metadata(d.join("o.png")).unwrap();
                assert_eq!(m.permissions().mode() & 0o777, 0o640);
                assert!(is_png(&d.join("o.png")));
            },
        },
        Case {
            name: "a FIFO as -o is written in place",
            setup: |d| {
                let ok = Command::new("mkfifo").arg(d.join("pipe")).status().unwrap();
                assert!(ok.success());
            },
            args: |d| gen(d.join("pipe")),
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["pipe", "read.png"],
            check: |d, _| {
                let m = std::fs::symlink_metadata(d.join("pipe")).unwrap();
                assert!(m.file_type().is_fifo());
                assert!(is_png(&d.join("read.png")));
            },
        },
        Case {
            name: "-o - writes the PNG to stdout",
            setup: none,
            args: |_| gen("-"),
            code: 0,
            stderr: &["saved <stdout>"],
            stdout: &[],
            files: &[],
            check: |_, o| assert!(o.stdout.starts_with(PNG)),
        },
        Case {
            name: "non-UTF-8 output name",
            setup: none,
            args: |d| {
                let mut name = d.as_os_str().to_owned();
                name.push(OsStr::from_bytes(b"/caf\xe9.png"));
                gen(name)
            },
            code: 0,
            stderr: &[],
            stdout: &["saved"],
            files: &["caf\u{fffd}.png"],
            check: no_check,
        },
        Case {
            name: "-s -1 picks and prints a random seed; -t -1 is auto",
            setup: none,
            args: |d| with(gen(d.join("o.png")), &["-s", "-1", "-t", "-1"]),
            code: 0,
            stderr: &[],
            stdout: &["(random)", "saved"],
            files: &["o.png"],
            check: no_check,
        },
        Case {
            name: "stable-diffusion.cpp spellings",
            setup: none,
            args: |d| {
                with(
                    gen(d.join("o.png")),
                    &[
                        "-M",
                        "img_gen",
                        "--cfg-scale",
                        "5",
                        "--sampling-method",
                        "euler_a",
                        "--scheduler",
                        "normal",
                        "--rng",
                        "cuda",
                        "--diffusion-fa",
                        "--fa",
                        "--offload-to-cpu",
                        "--clip-on-cpu",
                        "--vae-on-cpu",
                        "--eager-load",
                        "--stream-layers",
                        "--mmap",
                        "--clip-skip",
                        "-1",
                        "--backend",
                        "te=cpu,vae=cpu,diffusion=cpu",
                        "--params-backend",
                        "diffusion=cpu,te=ram",
                        "-n",
                        "blurry",
                        "-b",
                        "2",
                    ],
                )
            },
            code: 0,
            stderr: &[],
            stdout: &["saved", "o_2.png"],
            files: &["o.png", "o_2.png"],
            check: no_check,
        },
        Case {
            name: "img2img resizes the init image with a notice",
            setup: |d| {
                let img = sd_tensor::Image::filled(40, 24, &[200, 30, 30]).unwrap();
                img.save_png(d.join("init.png"), &[]).unwrap();
            },
            args: |d| {
                let mut v = with(gen(d.join("o.png")), &["--strength", "0.5", "--steps", "2"]);
                v.push("-i".into());
                v.push(d.join("init.png").into());
                v
            },
            code: 0,
            stderr: &["notice", "40x24", "64x64"],
            stdout: &["saved"],
            files: &["init.png", "o.png"],
            check: no_check,
        },
        Case {
            name: "upscale mode runs through the runtime: --backend and --max-vram apply",
            setup: |d| {
                let img = sd_tensor::Image::filled(24, 20, &[10, 200, 90]).unwrap();
                img.save_png(d.join("in.png"), &[]).unwrap();
                let out = Command::new(env!("CARGO_BIN_EXE_sd"))
                    .args(["upscale", "-t", "2", "--upscale-tile-size", "8"])
                    .arg("--upscale-model")
                    .arg(upscaler())
                    .arg("-i")
                    .arg(d.join("in.png"))
                    .arg("-o")
                    .arg(d.join("cpu.png"))
                    .output()
                    .unwrap();
                assert!(out.status.success());
            },
            args: |d| {
                let mut v: Vec<OsString> = ["upscale", "-t", "2", "--upscale-tile-size", "8"]
                    .iter()
                    .map(OsString::from)
                    .collect();
                for (flag, value) in [
                    ("--upscale-model", upscaler().into_os_string()),
                    ("-i", d.join("in.png").into()),
                    ("-o", d.join("sim.png").into()),
                    ("--backend", "sim:64".into()),
                    ("--max-vram", "24M".into()),
                ] {
                    v.push(flag.into());
                    v.push(value);
                }
                v
            },
            code: 0,
            stderr: &[],
            stdout: &["saved", "48x40"],
            files: &["cpu.png", "in.png", "sim.png"],
            check: |d, _| {
                let a = sd_tensor::Image::load_png(d.join("cpu.png")).unwrap();
                let b = sd_tensor::Image::load_png(d.join("sim.png")).unwrap();
                assert!(a.pixels() == b.pixels(), "the sim and CPU upscales differ");
            },
        },
        Case {
            name: "upscale mode: an impossible budget is an error, nothing written",
            setup: |d| {
                let img = sd_tensor::Image::filled(24, 20, &[10, 200, 90]).unwrap();
                img.save_png(d.join("in.png"), &[]).unwrap();
            },
            args: |d| {
                let mut v: Vec<OsString> = ["upscale", "-t", "2", "--backend", "sim:64"]
                    .iter()
                    .map(OsString::from)
                    .collect();
                for (flag, value) in [
                    ("--upscale-model", upscaler().into_os_string()),
                    ("-i", d.join("in.png").into()),
                    ("-o", d.join("sim.png").into()),
                    ("--max-vram", "1K".into()),
                ] {
                    v.push(flag.into());
                    v.push(value);
                }
                v
            },
            code: 1,
            stderr: &["budget"],
            stdout: &[],
            files: &["in.png"],
            check: no_check,
        },
        Case {
            name: "img2img from a JPEG",
            setup: none,
            args: |d| {
                let jpg =
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/red_circle.jpg");
                let mut v = with(gen(d.join("o.png")), &["--strength", "0.5", "--steps", "2"]);
                v.push("-i".into());
                v.push(jpg.into());
                v
            },
            code: 0,
            stderr: &["notice", "48x40"],
            stdout: &["saved"],
            files: &["o.png"],
            check: no_check,
        },
        Case {
            name: "an init image that is neither PNG nor JPEG: exit 1 naming it",
            setup: |d| std::fs::write(d.join("init.gif"), b"GIF89a....").unwrap(),
            args: |d| {
                let mut v = gen(d.join("o.png"));
                v.push("-i".into());
                v.push(d.join("init.gif").into());
                v
            },
            code: 1,
            stderr: &["init.gif", "not a PNG or JPEG"],
            stdout: &[],
            files: &["init.gif"],
            check: no_check,
        },
    ]
}

/// The built-in model with every UNet weight of one tensor set to NaN.
fn write_nan_model(path: &Path) {
    let mut bytes = std::fs::read(model()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (_, info) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.contains("diffusion_model") && k.contains("out.2.weight"))
        .or_else(|| {
            header
                .as_object()
                .unwrap()
                .iter()
                .find(|(k, _)| k.contains("diffusion_model") && k.ends_with("weight"))
        })
        .unwrap();
    let off = info["data_offsets"].as_array().unwrap();
    let (a, b) = (
        off[0].as_u64().unwrap() as usize,
        off[1].as_u64().unwrap() as usize,
    );
    // All-ones bytes are NaN in f32, f16 and bf16.
    bytes[8 + n + a..8 + n + b].fill(0xFF);
    std::fs::write(path, bytes).unwrap();
}

/// A rank-1 kohya LoRA for the UNet weight of kohya stem `stem` (`lora_unet_out_2` is the
/// output convolution `[4, C, 3, 3]` of the built-in model: C read from the model).
fn write_lora(path: &Path, stem: &str) {
    let bytes = std::fs::read(model()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let shape: Vec<usize> = header["model.diffusion_model.out.2.weight"]["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let (out, inner): (usize, usize) = (shape[0], shape[1..].iter().product());
    let down: Vec<f32> = (0..inner).map(|i| ((i % 7) as f32 - 3.0) * 0.01).collect();
    let up: Vec<f32> = (0..out).map(|i| 0.5 - i as f32 * 0.2).collect();
    let mut down_shape = vec![1usize];
    down_shape.extend(&shape[1..]);
    let tensors = [
        (format!("{stem}.lora_down.weight"), down_shape, down),
        (format!("{stem}.lora_up.weight"), vec![out, 1, 1, 1], up),
        (format!("{stem}.alpha"), vec![], vec![1.0]),
    ];
    let mut meta = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in &tensors {
        let start = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        meta.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&meta).unwrap();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend(head);
    file.extend(data);
    std::fs::write(path, file).unwrap();
}

/// The UserComment text of the EXIF block in a JPEG or WebP file (UTF-16 big-endian after
/// `UNICODE\0`, as A1111 writes it).
fn exif_text(bytes: &[u8]) -> String {
    let at = bytes
        .windows(8)
        .position(|w| w == b"UNICODE\0")
        .expect("no UserComment");
    let mut units = Vec::new();
    for c in bytes[at + 8..].chunks_exact(2) {
        let u = u16::from_be_bytes([c[0], c[1]]);
        if u == 0 {
            break;
        }
        units.push(u);
    }
    String::from_utf16_lossy(&units)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn every_case() {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sd-cli-table");
    let _ = std::fs::remove_dir_all(&root);
    let mut failures = Vec::new();
    for (i, case) in cases().into_iter().enumerate() {
        let dir = root.join(format!("case{i:02}"));
        std::fs::create_dir_all(&dir).unwrap();
        (case.setup)(&dir);
        // A FIFO needs a reader while sd writes it.
        let reader = (dir.join("pipe").exists()).then(|| {
            let (pipe, out) = (dir.join("pipe"), dir.join("read.png"));
            std::thread::spawn(move || {
                let bytes = std::fs::read(&pipe).unwrap();
                std::fs::write(out, bytes).unwrap();
            })
        });
        let env_file = dir.join(ENV_FILE);
        let env: Vec<(String, String)> = std::fs::read_to_string(&env_file)
            .map(|text| {
                text.lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        if env_file.exists() {
            std::fs::remove_file(&env_file).unwrap();
        }
        let start = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_sd"))
            .envs(env)
            .args((case.args)(&dir))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        if let Some(r) = reader {
            r.join().unwrap();
        }
        let err = String::from_utf8_lossy(&out.stderr);
        let text = String::from_utf8_lossy(&out.stdout);
        println!(
            "{:<72} exit {:?} ({:.1} s)",
            case.name,
            out.status.code(),
            start.elapsed().as_secs_f64()
        );
        let mut problems = Vec::new();
        if out.status.code() != Some(case.code) {
            problems.push(format!("exit {:?}, want {}", out.status.code(), case.code));
        }
        for w in case.stderr {
            if !err.contains(w) {
                problems.push(format!("stderr lacks '{w}'"));
            }
        }
        if !case.stdout.is_empty() {
            for w in case.stdout {
                if !text.contains(w) {
                    problems.push(format!("stdout lacks '{w}'"));
                }
            }
        }
        let got = names(&dir);
        if got != case.files {
            problems.push(format!("files {got:?}, want {:?}", case.files));
        }
        if problems.is_empty() {
            let run =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (case.check)(&dir, &out)));
            if run.is_err() {
                problems.push("check failed".into());
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{}: {}\n--- stderr:\n{err}",
                case.name,
                problems.join("; ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
