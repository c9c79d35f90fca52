//! `cargo xtask bench dit`: one DiT step on the CPU, sd-rs against diffusers, side by side.
//!
//! Both sides build the same network at the real widths with random weights and fewer
//! blocks (`--blocks N`: N blocks, FLUX N double and 2N single blocks; default 1), since a
//! whole FLUX.1-dev in f32 (48 GB) does not fit a small machine and every block of a DiT
//! does the same work: sd-rs through `sd-bench unet --backend CPU` (the `Runtime` path `sd`
//! runs; weights from `sd-bench write-weights`, f16, and with `--weights bf16,q8_0` those
//! types too, as `sd --type`), diffusers through `scripts/bench/dit_step_diffusers.py
//! --device cpu` (f32 and bf16, `SD_BENCH_TORCH_DTYPES`). The inputs are sd-bench's: a
//! `--latent N` side (default 64, a 512x512 image; FLUX and Qwen-Image take `(N/2)^2`
//! image tokens), FLUX with 512 T5 tokens and no CFG (batch 1), SD3.5 with CFG (batch 2,
//! 333 context tokens). `SD_BENCH_THREADS` (default 2) threads on both sides,
//! `SD_BENCH_REPS` (default 2) timed steps after a warm-up, the median reported.

use std::process::Command;

use crate::{bench_env, cargo, root, run, run_results, weights_arg, BuildEnv, Res};

/// The DiTs both sides build (`sd-bench --config` names, which the diffusers script shares).
const MODELS: [&str; 4] = ["flux-dev", "sd35-large", "sd35-medium", "qwen-image"];

/// Runs the benchmark (see the module doc).
pub fn bench(benv: &BuildEnv, args: &[String]) -> Res<()> {
    let mut model = "flux-dev".to_string();
    let mut blocks = "1".to_string();
    let mut latent = "64".to_string();
    let mut weights = vec!["f16".to_string()];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |what: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("bench dit: {a} needs {what}"))
        };
        match a.as_str() {
            "--model" => model = value("a model")?,
            "--blocks" => blocks = value("a count")?,
            "--latent" => latent = value("a size")?,
            "--weights" => weights = weights_arg(Some(&value("a list")?), "bench dit")?,
            other => {
                return Err(format!(
                    "bench dit: unknown argument '{other}' (--model, --blocks, --latent, --weights)"
                ))
            }
        }
    }
    if !MODELS.contains(&model.as_str()) {
        return Err(format!(
            "bench dit: --model {model}: one of {}",
            MODELS.join(", ")
        ));
    }
    if blocks.parse::<u32>().map_or(true, |n| n == 0) {
        return Err(format!("bench dit: --blocks {blocks}: a positive count"));
    }
    if latent.parse::<u32>().map_or(true, |n| n == 0 || n % 2 != 0) {
        return Err(format!(
            "bench dit: --latent {latent}: a positive even size"
        ));
    }
    let (threads, reps, dtypes) = bench_env();
    run(cargo(benv).args(["build", "--release", "-p", "sd-cli", "--bin", "sd-bench"]))?;
    let exe = root().join("target/release/sd-bench");
    let dir = root().join(format!("target/bench/{model}-{blocks}-blocks"));
    run(Command::new(&exe)
        .arg("write-weights")
        .arg(&dir)
        .args(["--config", &model, "--blocks", &blocks]))?;
    let file = dir.join("unet.safetensors");

    // sd-rs: one run per weight type; `step_ms_median` and the step's TFLOP from its JSON.
    let mut ours = Vec::new();
    let mut tflop = 0.0;
    for w in &weights {
        let mut cmd = Command::new(&exe);
        cmd.args(["unet", "--backend", "CPU", "--config", &model, "--weights"])
            .arg(&file)
            .args(["--latent", &latent, "--steps", &reps, "--threads", &threads]);
        if w != "f16" {
            cmd.args(["--type", w]);
        }
        let json = last_json_line(&crate::capture(&mut cmd)?)?;
        tflop = json_number(&json, "graph_tflops")?;
        ours.push((w.clone(), json_number(&json, "step_ms_median")? / 1e3));
    }
    let _ = std::fs::remove_dir_all(&dir);

    // diffusers on PyTorch's CPU, each dtype asked for.
    let script = root().join("scripts/bench/dit_step_diffusers.py");
    let mut theirs = Vec::new();
    for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
        let mut py = Command::new("python3");
        py.arg(&script)
            .args(["--device", "cpu", "--model", &model, "--blocks", &blocks])
            .args(["--latent", &latent, "--dtype", dtype, "--reps", &reps])
            .args(["--threads", &threads]);
        let r = run_results(&mut py)?;
        let ms = crate::result(&r, "step_ms_median")?;
        theirs.push((dtype.to_string(), ms / 1e3));
    }

    let gflop = tflop * 1e3;
    println!();
    println!(
        "{model}, {blocks} block(s) at the real widths, {latent}x{latent} latent, {threads} CPU threads ({gflop:.0} GFLOP a step)"
    );
    for (w, s) in &ours {
        println!(
            "  sd-rs, {w:4} weights          {s:8.2} s  {:6.1} GFLOP/s",
            gflop / s
        );
        for (dtype, t) in &theirs {
            println!("    sd-rs {w} / diffusers {dtype}: time {:.2}", s / t);
        }
    }
    for (dtype, t) in &theirs {
        println!(
            "  diffusers (torch, {dtype:4})     {t:8.2} s  {:6.1} GFLOP/s",
            gflop / t
        );
    }
    Ok(())
}

/// The last line of `out` that is a JSON object (sd-bench prints its result last).
fn last_json_line(out: &str) -> Res<String> {
    out.lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .map(str::to_string)
        .ok_or_else(|| "sd-bench printed no JSON result".to_string())
}

/// The number under `"key":` in a one-line JSON object (sd-bench's compact output, the
/// upscale benchmark's `"key": value`): the benchmarks' results are flat, so the xtask
/// keeps no JSON dependency.
pub(crate) fn json_number(json: &str, key: &str) -> Res<f64> {
    let pat = format!("\"{key}\":");
    let rest = json
        .split_once(&pat)
        .map(|(_, r)| r)
        .ok_or_else(|| format!("no {key} in the result {json}"))?;
    let v = rest.split([',', '}']).next().unwrap_or("").trim();
    v.parse()
        .map_err(|e| format!("the result's {key} {v:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_read_from_sd_bench_json() {
        let out = "warm-up\n{\"a\":1,\"graph_tflops\":0.25,\"step_ms_median\":1234.5}\n";
        let j = last_json_line(out).unwrap();
        assert_eq!(json_number(&j, "graph_tflops").unwrap(), 0.25);
        assert_eq!(json_number(&j, "step_ms_median").unwrap(), 1234.5);
        assert!(json_number(&j, "missing").is_err());
        assert_eq!(
            json_number("{\"seconds\": 2.5, \"x\": 1}", "seconds").unwrap(),
            2.5
        );
        assert!(json_number("{\"step_ms_median\":null}", "step_ms_median").is_err());
        assert!(last_json_line("no json here").is_err());
    }
}
