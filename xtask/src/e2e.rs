//! `cargo xtask bench e2e`: one txt2img run end to end on the CPU, `sd` against
//! stable-diffusion.cpp, side by side on one random full-size SD1.5 checkpoint.
//!
//! The checkpoint (`target/bench/sd15-random.safetensors`, f16, the original single-file
//! layout both programs read) is written once by `scripts/device/random_sd15.py`. Both
//! programs then make the same image: 512x512, CFG 7, Euler, seed 42, `SD_BENCH_STEPS`
//! steps (default 2), `SD_BENCH_THREADS` threads (default 2). stable-diffusion.cpp runs
//! through `scripts/bench/sdcpp_txt2img.py` (the `stable-diffusion-cpp-python` package,
//! built from source; `pip install stable-diffusion-cpp-python`). Prints each program's
//! whole-run seconds (the process, loading included) and sampling seconds (from its own
//! log), and the ratios.

use std::env;
use std::process::Command;
use std::time::Instant;

use crate::{cargo, root, run, BuildEnv, Res};

/// One program's times.
struct Timing {
    whole: f64,
    sampling: f64,
}

/// Runs the benchmark (see the module doc).
pub fn bench(benv: &BuildEnv) -> Res<()> {
    let var = |k: &str, d: &str| env::var(k).unwrap_or_else(|_| d.into());
    let (threads, steps) = (var("SD_BENCH_THREADS", "2"), var("SD_BENCH_STEPS", "2"));
    run(cargo(benv).args(["build", "--release", "-p", "sd-cli", "--bin", "sd"]))?;
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let ck = dir.join("sd15-random.safetensors");
    if !ck.exists() {
        run(Command::new("python3")
            .arg(root().join("scripts/device/random_sd15.py"))
            .arg(&ck)
            .arg("--names")
            .arg(root().join("crates/sd-formats/tests/fixtures/names")))?;
    }
    let prompt = "a photograph of an astronaut riding a horse";
    let mut ours = Command::new(root().join("target/release/sd"));
    ours.arg("-m")
        .arg(&ck)
        .args(["-p", prompt, "-W", "512", "-H", "512", "--cfg-scale", "7"])
        .args(["--sampling-method", "euler", "-s", "42"])
        .args(["--steps", &steps, "-t", &threads, "-o"])
        .arg(dir.join("e2e-sd-rs.png"));
    let ours = timed(&mut ours, sd_rs_sampling)?;
    let mut peer = Command::new("python3");
    peer.arg(root().join("scripts/bench/sdcpp_txt2img.py"))
        .arg("--model")
        .arg(&ck)
        .args(["--prompt", prompt, "--steps", &steps, "--threads", &threads])
        .arg("--out")
        .arg(dir.join("e2e-sdcpp.png"));
    let peer = timed(&mut peer, sdcpp_sampling)?;
    println!();
    println!(
        "txt2img SD1.5 (random f16 checkpoint), 512x512, CFG 7, Euler, {steps} steps, {threads} CPU threads"
    );
    println!(
        "  sd-rs `sd`             whole run {:7.2} s   sampling {:7.2} s",
        ours.whole, ours.sampling
    );
    println!(
        "  stable-diffusion.cpp   whole run {:7.2} s   sampling {:7.2} s",
        peer.whole, peer.sampling
    );
    println!(
        "  sd-rs / stable-diffusion.cpp: whole run {:.2}, sampling {:.2}",
        ours.whole / peer.whole,
        ours.sampling / peer.sampling
    );
    Ok(())
}

/// Runs `cmd` to completion, echoing its stderr, and reads its sampling seconds from its
/// output with `sampling`.
fn timed(cmd: &mut Command, sampling: fn(&str) -> Option<f64>) -> Res<Timing> {
    eprintln!("+ {cmd:?}");
    let start = Instant::now();
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let whole = start.elapsed().as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{text}");
    if !out.status.success() {
        return Err(format!("{cmd:?} failed with {}", out.status));
    }
    let sampling = sampling(&text).ok_or_else(|| format!("no sampling time in {cmd:?}'s log"))?;
    Ok(Timing { whole, sampling })
}

/// `sd`'s sampling seconds: its last `sampling: N/N steps done (S s)` line.
fn sd_rs_sampling(log: &str) -> Option<f64> {
    log.lines()
        .rev()
        .find_map(|l| {
            l.strip_prefix("sampling: ")?
                .split_once(" done (")?
                .1
                .strip_suffix(" s)")
        })
        .and_then(|s| s.trim().parse().ok())
}

/// stable-diffusion.cpp's sampling seconds: its log's `sampling completed, taking S s`.
fn sdcpp_sampling(log: &str) -> Option<f64> {
    log.lines()
        .find_map(|l| {
            l.split_once("sampling completed, taking ")?
                .1
                .strip_suffix('s')
        })
        .and_then(|s| s.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_times_are_read_from_the_logs() {
        let ours = "loading: 1/1 tensors done (0.1 s)\nsampling: 1/2 steps (14.0 s)\n\
                    sampling: 2/2 steps done (27.5 s)\nsaved x.png";
        assert_eq!(sd_rs_sampling(ours), Some(27.5));
        assert_eq!(sd_rs_sampling("nothing"), None);
        let peer = "[INFO ] stable-diffusion.cpp:3970 - sampling completed, taking 41.25s\n";
        assert_eq!(sdcpp_sampling(peer), Some(41.25));
    }
}
