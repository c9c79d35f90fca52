//! The `sd-bench` binary end to end on the CPU backend: random weights written and a UNet
//! step run through the engine (resident, and streamed under a budget), and its flag, file
//! and module errors.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd-bench"))
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
    let out = bench()
        .args(["write-weights", dir.to_str().unwrap(), "--config", "tiny"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let weights = dir.join("unet.safetensors");
    let mut outputs = Vec::new();
    for extra in [
        &["--params", "device"][..],
        &["--params", "disk", "--max-vram", "0.5"],
        &[
            "--params",
            "disk",
            "--max-vram",
            "0.5",
            "--async-upload",
            "on",
        ],
    ] {
        let out = bench()
            .args([
                "unet",
                "--config",
                "tiny",
                "--backend",
                "CPU",
                "--threads",
                "2",
            ])
            .args(["--steps", "1", "--weights", weights.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines = json_lines(&out.stdout);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("\"output_finite\":true"), "{}", lines[0]);
        // The CPU backend has no copy stream, whatever the switch says; the upload wait
        // is reported apart.
        assert!(lines[0].contains("\"copy_stream\":false"), "{}", lines[0]);
        assert!(lines[0].contains("\"upload_wait\":"), "{}", lines[0]);
        // Off by default.
        let switch = if extra.contains(&"on") {
            "true"
        } else {
            "false"
        };
        assert!(
            lines[0].contains(&format!("\"async_upload\":{switch}")),
            "{}",
            lines[0]
        );
        let rms = lines[0].split("\"output_rms\":").nth(1).unwrap();
        outputs.push(rms.split([',', '}']).next().unwrap().to_string());
    }
    // Same weights and inputs: the same output wherever the weights lived.
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
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
/// read back with their sizes from the tensors): weights on the device and in RAM under a
/// budget give the same output (the CPU backend does not segment; the simulated-device
/// tests cover that).
#[test]
fn tiny_dit_step_runs_resident_and_streamed() {
    resident_equals_streamed("tiny-dit");
}

/// The LLM text encoder path (`--config tiny-llm`, as `qwen25vl-7b` on a GPU): one prompt
/// with its weights on the device and in RAM under a budget, the same output.
#[test]
fn tiny_llm_runs_resident_and_streamed() {
    resident_equals_streamed("tiny-llm");
}

fn resident_equals_streamed(config: &str) {
    let dir = std::env::temp_dir().join(format!("sd-bench-{config}-{}", std::process::id()));
    let out = bench()
        .args(["write-weights", dir.to_str().unwrap(), "--config", config])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let weights = dir.join("unet.safetensors");
    let mut outputs = Vec::new();
    for extra in [
        &["--params", "device"][..],
        &["--params", "ram", "--max-vram", "0.2"],
    ] {
        let out = bench()
            .args(["unet", "--config", config, "--backend", "CPU"])
            .args(["--threads", "2", "--steps", "1"])
            .args(["--weights", weights.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines = json_lines(&out.stdout);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("\"output_finite\":true"), "{}", lines[0]);
        let segments = lines[0].split("\"segments\":").nth(1).unwrap();
        let segments: usize = segments.split([',', '}']).next().unwrap().parse().unwrap();
        let rms = lines[0].split("\"output_rms\":").nth(1).unwrap();
        outputs.push((segments, rms.split([',', '}']).next().unwrap().to_string()));
    }
    assert_eq!(outputs[0], outputs[1]);
    let _ = std::fs::remove_dir_all(&dir);
}
