//! The `sd-bench` binary end to end on the CPU backend and a simulated device: random
//! weights written and a UNet step run through the runtime `sd` uses (resident, and
//! streamed under a budget), and its flag, file and module errors.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd-bench"))
}

/// Runs `cmd`, asserting that it succeeded (showing its stderr otherwise), and returns
/// its JSON lines.
fn succeed(cmd: &mut Command) -> Vec<String> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    json_lines(&out.stdout)
}

fn json_lines(stdout: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(str::to_string)
        .collect()
}

#[test]
fn tiny_unet_step_runs_through_the_engine() {
    let dir = std::env::temp_dir().join(format!("sd-bench-cli-{}", std::process::id()));
    succeed(bench().args(["write-weights", dir.to_str().unwrap(), "--config", "tiny"]));
    let weights = dir.join("unet.safetensors");
    let mut outputs = Vec::new();
    // On the CPU and on a simulated device (the CPU's arithmetic without its own kernels),
    // resident and streamed under a budget.
    for extra in [
        &["--backend", "CPU", "--params", "device"][..],
        &["--backend", "CPU", "--params", "disk"],
        &["--backend", "sim:512", "--params", "device"],
        &[
            "--backend",
            "sim:512",
            "--params",
            "disk",
            "--max-vram",
            "0.5",
        ],
        &[
            "--backend",
            "sim:512",
            "--params",
            "disk",
            "--max-vram",
            "0.5",
            "--async-upload",
            "on",
        ],
    ] {
        let lines = succeed(
            bench()
                .args(["unet", "--config", "tiny", "--threads", "2"])
                .args(["--steps", "1", "--weights", weights.to_str().unwrap()])
                .args(extra),
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
        let line = &lines[0];
        assert!(line.contains("\"output_finite\":true"), "{line}");
        // Through the runtime `sd` uses.
        assert!(line.contains("\"path\":\"runtime\""), "{line}");
        // The CPU backend has no copy stream, whatever the switch says; the upload wait
        // is reported apart.
        if extra.contains(&"CPU") {
            assert!(line.contains("\"copy_stream\":false"), "{line}");
        }
        assert!(line.contains("\"upload_wait\":"), "{line}");
        // Off by default.
        let switch = if extra.contains(&"on") {
            "true"
        } else {
            "false"
        };
        assert!(
            line.contains(&format!("\"async_upload\":{switch}")),
            "{line}"
        );
        let field = |key: &str| {
            let v = line.split(&format!("\"{key}\":")).nth(1).unwrap();
            v.split([',', '}']).next().unwrap().to_string()
        };
        // Under the budget: in segments, on a simulated device with no fault.
        if extra.contains(&"--max-vram") {
            assert_eq!(field("segmented"), "true", "{line}");
            assert_eq!(field("sim_faults"), "0", "{line}");
        }
        outputs.push(field("output_rms"));
    }
    // Same weights and inputs: the same output wherever the weights lived, and on the
    // simulated device the same whole or in segments.
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[2], outputs[3]);
    assert_eq!(outputs[2], outputs[4]);
    // A budget is for a device that is not the CPU.
    let out = bench()
        .args([
            "unet",
            "--config",
            "tiny",
            "--backend",
            "CPU",
            "--max-vram",
            "0.5",
        ])
        .args(["--weights", weights.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("sim:MiB"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_flags_files_and_modules_are_clear_errors() {
    let out = bench().args(["unet", "--backend", "CPU"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--weights"));

    let out = bench().args(["unet", "--no-such", "x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--no-such"));

    let missing = std::env::temp_dir().join("sd-bench-no-such/unet.safetensors");
    let out = bench()
        .args([
            "unet",
            "--backend",
            "CPU",
            "--weights",
            missing.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sd-bench-no-such"));

    let out = bench()
        .args([
            "copy-bw",
            "--backend",
            "CPU",
            "--module",
            "/nonexistent/libggml-cuda.so",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/libggml-cuda.so"), "{err}");

    // A simulated device needs a positive size that fits in bytes (checked before the
    // weights are read); a prefetch depth is at least one segment.
    for bad in ["sim:0", "sim:x", "sim:99999999999999999"] {
        let out = bench()
            .args([
                "unet",
                "--backend",
                bad,
                "--weights",
                missing.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(bad) && err.contains("positive size"), "{err}");
    }
    // Weight types as `sd --type` takes them (no integers, no f64), checked before the
    // weights are read.
    for bad in ["i32", "f64", "q9_0"] {
        let out = bench()
            .args([
                "unet",
                "--weights",
                missing.to_str().unwrap(),
                "--type",
                bad,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("--type {bad}")), "{err}");
    }
    let out = bench()
        .args(["unet", "--weights", "w", "--prefetch-depth", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prefetch-depth"));

    let out = bench()
        .args(["copy-bw", "--backend", "NO_SUCH_DEVICE"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("NO_SUCH_DEVICE"));
}

/// The DiT path of `sd-bench` (random SD3-style weights written with Stability's names,
/// read back with their sizes from the tensors): weights on a simulated device and in RAM
/// under a budget (in segments) give the same output.
#[test]
fn tiny_dit_step_runs_resident_and_streamed() {
    resident_equals_streamed("tiny-dit", "0.7");
}

/// The LLM text encoder path (`--config tiny-llm`, as `qwen25vl-7b` on a GPU): one prompt
/// with its weights on the device and in RAM under a budget, the same output.
#[test]
fn tiny_llm_runs_resident_and_streamed() {
    resident_equals_streamed("tiny-llm", "0.85");
}

/// `--type bf16` (as `sd --type bf16`, the AMX tiles' type; `cargo xtask bench dit
/// --weights bf16`) converts the linear weights as they load: the DiT step runs and its
/// output moves by bf16's rounding, no further.
#[test]
fn weights_convert_to_bf16_as_they_load() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    succeed(bench().args(["write-weights", d, "--config", "tiny-dit"]));
    let weights = dir.path().join("unet.safetensors");
    let rms = |extra: &[&str]| -> f64 {
        let lines = succeed(
            bench()
                .args([
                    "unet",
                    "--config",
                    "tiny-dit",
                    "--threads",
                    "2",
                    "--steps",
                    "1",
                ])
                .args(["--weights", weights.to_str().unwrap()])
                .args(extra),
        );
        assert!(lines[0].contains("\"output_finite\":true"), "{}", lines[0]);
        let v = lines[0].split("\"output_rms\":").nth(1).unwrap();
        v.split([',', '}']).next().unwrap().parse().unwrap()
    };
    let (f16, bf16) = (rms(&[]), rms(&["--type", "bf16"]));
    assert!(f16 != bf16, "bf16 weights computed as the f16 ones: {f16}");
    assert!((f16 - bf16).abs() < 0.02 * f16, "{f16} vs {bf16}");
}

/// `budget`: a fraction of the weight bytes under the whole graph's need and over its
/// smallest segment's.
fn resident_equals_streamed(config: &str, budget: &str) {
    let dir = std::env::temp_dir().join(format!("sd-bench-{config}-{}", std::process::id()));
    succeed(bench().args(["write-weights", dir.to_str().unwrap(), "--config", config]));
    let weights = dir.join("unet.safetensors");
    let mut outputs = Vec::new();
    for extra in [
        &["--params", "device"][..],
        &["--params", "ram", "--max-vram", budget],
    ] {
        let lines = succeed(
            bench()
                .args(["unet", "--config", config, "--backend", "sim:512"])
                .args(["--threads", "2", "--steps", "1"])
                .args(["--weights", weights.to_str().unwrap()])
                .args(extra),
        );
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("\"output_finite\":true"), "{}", lines[0]);
        let segments = lines[0].split("\"segments\":").nth(1).unwrap();
        let segments: usize = segments.split([',', '}']).next().unwrap().parse().unwrap();
        let rms = lines[0].split("\"output_rms\":").nth(1).unwrap();
        outputs.push((segments, rms.split([',', '}']).next().unwrap().to_string()));
    }
    // Whole, then in segments under the budget, with the same output.
    assert_eq!(outputs[0].0, 1, "{outputs:?}");
    assert!(outputs[1].0 > 1, "{outputs:?}");
    assert_eq!(outputs[0].1, outputs[1].1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `SD_BENCH_SPAN_TIMES=1`: the host time of the engine's spans per timed step in the JSON
/// line, with the spans of a budgeted step (segments queued, capacity checks, prefetches).
#[test]
fn span_times_report_the_engines_host_work_per_step() {
    let dir = tempfile::tempdir().unwrap();
    succeed(bench().args([
        "write-weights",
        dir.path().to_str().unwrap(),
        "--config",
        "tiny",
    ]));
    let weights = dir.path().join("unet.safetensors");
    let run = |spans: bool| {
        let mut cmd = bench();
        cmd.args(["unet", "--config", "tiny", "--threads", "2", "--steps", "2"])
            .args(["--weights", weights.to_str().unwrap()])
            .args([
                "--backend",
                "sim:512",
                "--params",
                "pinned",
                "--max-vram",
                "0.5",
            ]);
        if spans {
            cmd.env("SD_BENCH_SPAN_TIMES", "1");
        }
        let lines = succeed(&mut cmd);
        assert_eq!(lines.len(), 1, "{lines:?}");
        serde_json::from_str::<serde_json::Value>(&lines[0]).unwrap()
    };
    let on = run(true);
    let spans = on["span_times"]
        .as_object()
        .expect("span_times is an object");
    let segments = on["segments"].as_f64().unwrap();
    assert!(segments > 1.0, "{on}");
    // One launch span per segment of each timed step, and the execution around them.
    assert_eq!(
        spans["segment_launch"]["count"].as_f64(),
        Some(segments),
        "{on}"
    );
    assert_eq!(spans["execute"]["count"].as_f64(), Some(1.0), "{on}");
    for name in ["ensure_capacity", "prefetch", "device_memory_report"] {
        assert!(spans[name]["count"].as_f64().unwrap() > 0.0, "{name}: {on}");
    }
    for v in spans.values() {
        let (total, own) = (
            v["total_ms"].as_f64().unwrap(),
            v["self_ms"].as_f64().unwrap(),
        );
        assert!(own >= 0.0 && own <= total + 1e-9, "{on}");
    }
    // A span's total holds its children's: the execution holds every segment's launch.
    assert!(
        spans["execute"]["total_ms"].as_f64() >= spans["segment_launch"]["total_ms"].as_f64(),
        "{on}"
    );
    // Off: an empty object.
    let off = run(false);
    assert_eq!(off["span_times"], serde_json::json!({}), "{off}");
}

/// `copy-bw --contention on`: copies of four sizes and copies beside computing graphs, as
/// rates (the CPU backend copies from pageable memory).
#[test]
fn copy_bandwidth_probe_reports_sizes_and_contention() {
    let lines = succeed(bench().args([
        "copy-bw",
        "--backend",
        "CPU",
        "--mib",
        "4",
        "--contention",
        "on",
    ]));
    assert_eq!(lines.len(), 1, "{lines:?}");
    let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    let c = &v["contention"];
    for size in ["1_mib", "4_mib", "16_mib", "64_mib"] {
        assert!(c["sizes"][size].as_f64().unwrap() > 0.0, "{v}");
    }
    for case in ["alone", "products", "tiny_ops"] {
        assert!(
            c["concurrent_64_mib"][case]["gb_per_s"].as_f64().unwrap() > 0.0,
            "{v}"
        );
    }
    assert_eq!(c["concurrent_64_mib"]["alone"]["graphs"], 0, "{v}");
    // Without the flag, no probe.
    let out = bench()
        .args(["copy-bw", "--backend", "CPU", "--mib", "4"])
        .output()
        .unwrap();
    let lines = json_lines(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert!(v["contention"].is_null(), "{v}");
}

#[test]
fn attention_probe_variants_compute_one_attention() {
    let lines = succeed(bench().args([
        "attn",
        "--backend",
        "CPU",
        "--shape",
        "64,3,96,2",
        "--iters",
        "2",
        "--threads",
        "2",
    ]));
    assert_eq!(lines.len(), 4, "{lines:?}");
    let v: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let variants: Vec<&str> = v.iter().map(|x| x["variant"].as_str().unwrap()).collect();
    assert_eq!(variants, ["views", "heads", "heads_f16q", "products"]);
    for x in &v {
        assert!(x["ms"].as_f64().unwrap() > 0.0, "{x}");
        assert!(x["mean_abs"].as_f64().unwrap() > 1e-3, "{x}");
    }
    // The same values laid out per head: the same kernel, the same bits; products and
    // softmax in f32 against f16 K/V: close.
    assert_eq!(v[1]["max_diff"].as_f64(), Some(0.0), "{}", v[1]);
    assert!(v[3]["max_diff"].as_f64().unwrap() < 1e-3, "{}", v[3]);
    // A shape of three numbers is a usage error naming the flag.
    let out = bench()
        .args(["attn", "--shape", "64,3,96"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shape"));
}
