//! `cargo xtask bench e2e`: one txt2img run end to end on the CPU, `sd` against
//! stable-diffusion.cpp, side by side on one random full-size SD1.5 checkpoint.
//!
//! The checkpoint (`target/bench/sd15-random.safetensors`, f16, the original single-file
//! layout both programs read) is written once by `scripts/device/random_sd15.py`. Both
//! programs then make the same image: 512x512, CFG 7, Euler, seed 42, `SD_BENCH_STEPS`
//! steps (default 2), `SD_BENCH_THREADS` threads (default 2). stable-diffusion.cpp runs
//! through `scripts/bench/sdcpp_txt2img.py` (the `stable-diffusion-cpp-python` package,
//! built from source; `pip install stable-diffusion-cpp-python`). Prints each program's
//! whole-run seconds (the process, loading included), sampling seconds and VAE decode
//! seconds (each from the program's own log: `sd -v`'s `sampling completed` and `decoding
//! completed`, stable-diffusion.cpp's `sampling completed, taking` and `decode_first_stage
//! completed, taking`), and the ratios.

use std::env;
use std::process::Command;
use std::time::Instant;

use crate::{cargo, root, run, BuildEnv, Res};

/// One program's times.
struct Timing {
    whole: f64,
    sampling: f64,
    decode: f64,
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
        .args(["--steps", &steps, "-t", &threads, "-v", "-o"])
        .arg(dir.join("e2e-sd-rs.png"));
    let ours = timed(&mut ours, [sd_rs_sampling, sd_rs_decode])?;
    let mut peer = Command::new("python3");
    peer.arg(root().join("scripts/bench/sdcpp_txt2img.py"))
        .arg("--model")
        .arg(&ck)
        .args(["--prompt", prompt, "--steps", &steps, "--threads", &threads])
        .arg("--out")
        .arg(dir.join("e2e-sdcpp.png"));
    let peer = timed(&mut peer, [sdcpp_sampling, sdcpp_decode])?;
    println!();
    println!(
        "txt2img SD1.5 (random f16 checkpoint), 512x512, CFG 7, Euler, {steps} steps, {threads} CPU threads"
    );
    for (name, t) in [("sd-rs `sd`", &ours), ("stable-diffusion.cpp", &peer)] {
        println!(
            "  {name:<22} whole run {:7.2} s   sampling {:7.2} s   VAE decode {:7.2} s",
            t.whole, t.sampling, t.decode
        );
    }
    println!(
        "  sd-rs / stable-diffusion.cpp: whole run {:.2}, sampling {:.2}, VAE decode {:.2}",
        ours.whole / peer.whole,
        ours.sampling / peer.sampling,
        ours.decode / peer.decode
    );
    Ok(())
}

/// Runs `cmd` to completion, echoing its output, and reads its sampling and decode seconds
/// from its log with `parse`.
fn timed(cmd: &mut Command, parse: [fn(&str) -> Option<f64>; 2]) -> Res<Timing> {
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
    let read = |f: fn(&str) -> Option<f64>, what: &str| {
        f(&text).ok_or_else(|| format!("no {what} time in {cmd:?}'s log"))
    };
    Ok(Timing {
        whole,
        sampling: read(parse[0], "sampling")?,
        decode: read(parse[1], "decode")?,
    })
}

/// `sd -v`'s sampling seconds: its `sampling completed seconds=S` log line.
fn sd_rs_sampling(log: &str) -> Option<f64> {
    sd_rs_seconds(log, "sampling completed")
}

/// `sd -v`'s decode seconds: its `decoding completed seconds=S` log line.
fn sd_rs_decode(log: &str) -> Option<f64> {
    sd_rs_seconds(log, "decoding completed")
}

/// The `seconds=` field of `sd -v`'s first log line with `event`.
fn sd_rs_seconds(log: &str, event: &str) -> Option<f64> {
    log.lines()
        .find(|l| l.contains(event))?
        .split_once("seconds=")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// stable-diffusion.cpp's sampling seconds: its log's `sampling completed, taking S s`.
fn sdcpp_sampling(log: &str) -> Option<f64> {
    sdcpp_seconds(log, "sampling completed, taking ")
}

/// stable-diffusion.cpp's decode seconds: its `decode_first_stage completed, taking S s`.
fn sdcpp_decode(log: &str) -> Option<f64> {
    sdcpp_seconds(log, "decode_first_stage completed, taking ")
}

/// The seconds after `event` in stable-diffusion.cpp's first log line with it.
fn sdcpp_seconds(log: &str, event: &str) -> Option<f64> {
    log.lines()
        .find_map(|l| l.split_once(event)?.1.trim().strip_suffix('s'))
        .and_then(|s| s.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_read_from_the_logs() {
        let ours = "sampling: 1/2 steps (14.0 s)\n2026-12-05T10:40:01Z  INFO generate{steps=2}: \
                    sd_pipeline::generate: sampling completed seconds=27.5 steps=2\n\
                    INFO generate: sd_pipeline::generate: decoding completed seconds=20.5\n";
        assert_eq!(sd_rs_sampling(ours), Some(27.5));
        assert_eq!(sd_rs_decode(ours), Some(20.5));
        assert_eq!(sd_rs_sampling("nothing"), None);
        let peer = "[INFO ] stable-diffusion.cpp:3970 - sampling completed, taking 41.25s\n\
                    stable-diffusion.cpp:3212 - decode_first_stage completed, taking 54.20s\n";
        assert_eq!(sdcpp_sampling(peer), Some(41.25));
        assert_eq!(sdcpp_decode(peer), Some(54.2));
    }
}
