//! The `sd` binary end to end: device listing, the ggml self-check, and flag errors.

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
    assert!(String::from_utf8_lossy(&out.stderr).contains("-t/--threads"));
}
