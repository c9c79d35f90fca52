//! `cargo xtask`: the project's entry points.
//!
//! - `cargo xtask demo`: the main job (bootstraps native build tools, builds `sd` in release
//!   mode, lists the devices and generates `out/demo.png` with the built-in model; extra
//!   arguments are passed to `sd` instead).
//! - `cargo xtask test`: the whole test run as CI does it (rustfmt, clippy, tests).
//! - `cargo xtask setup`: only installs what the ggml build needs (CMake, libclang).
//! - `cargo xtask bench <name>`: benchmarks (`matmul`, `exec`, `upscale`).
//!
//! xtask itself has no dependencies, so it builds before CMake or libclang exist and can
//! install them: with apt-get when running as root, otherwise from PyPI with pip.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    let result = match cmd {
        "setup" => setup().map(|_| ()),
        "demo" => demo(rest),
        "test" => test(rest),
        "bench" => bench(rest),
        _ => {
            eprintln!("usage: cargo xtask <setup|demo|test|bench NAME>");
            exit(if cmd == "help" || cmd == "--help" {
                0
            } else {
                2
            });
        }
    };
    if let Err(e) = result {
        eprintln!("xtask {cmd}: {e}");
        exit(1);
    }
}

type Res<T> = Result<T, String>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Res<()> {
    eprintln!("+ {cmd:?}");
    let st = cmd
        .status()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {st}"))
    }
}

fn works(prog: &str, arg: &str) -> bool {
    Command::new(prog)
        .arg(arg)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Finds a directory holding libclang, as clang-sys would search it.
fn find_libclang() -> Option<PathBuf> {
    if let Some(p) = env::var_os("LIBCLANG_PATH") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/usr/lib") {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("llvm-") {
                dirs.push(e.path().join("lib"));
            }
        }
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/local/lib",
        ]
        .map(PathBuf::from),
    );
    dirs.into_iter().find(|d| {
        std::fs::read_dir(d)
            .map(|rd| {
                rd.flatten().any(|e| {
                    e.file_name().to_string_lossy().starts_with("libclang")
                        && e.file_name().to_string_lossy().contains(".so")
                })
            })
            .unwrap_or(false)
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Environment variables the build needs after setup (PATH and LIBCLANG_PATH from pip).
#[derive(Default)]
struct BuildEnv {
    vars: Vec<(String, String)>,
}

impl BuildEnv {
    fn apply(&self, cmd: &mut Command) {
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
    }
}

fn setup() -> Res<BuildEnv> {
    let mut benv = BuildEnv::default();
    let have_cmake = works("cmake", "--version");
    let have_clang = find_libclang().is_some();
    if have_cmake && have_clang {
        return Ok(benv);
    }
    eprintln!("xtask: installing native build tools (cmake: {have_cmake}, libclang: {have_clang})");
    if is_root() && works("apt-get", "--version") {
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "cmake", "libclang-dev", "clang"])
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
        return Ok(benv);
    }
    // Without root: cmake and libclang wheels from PyPI.
    run(Command::new("python3").args([
        "-m", "pip", "install", "--user", "--quiet", "cmake", "libclang",
    ]))?;
    let out = Command::new("python3")
        .args(["-c", "import os,site,clang; print(site.USER_BASE + '/bin'); print(os.path.join(os.path.dirname(clang.__file__), 'native'))"])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines();
    let bin = lines.next().ok_or("pip did not report its bin dir")?;
    let native = lines.next().ok_or("pip libclang has no native dir")?;
    let path = format!("{bin}:{}", env::var("PATH").unwrap_or_default());
    benv.vars.push(("PATH".into(), path));
    benv.vars.push(("LIBCLANG_PATH".into(), native.to_string()));
    // The wheel has no clang resource headers; let bindgen use gcc's.
    if let Ok(o) = Command::new("gcc").arg("-print-file-name=include").output() {
        let inc = String::from_utf8_lossy(&o.stdout).trim().to_string();
        benv.vars
            .push(("BINDGEN_EXTRA_CLANG_ARGS".into(), format!("-I{inc}")));
    }
    Ok(benv)
}

fn cargo(benv: &BuildEnv) -> Command {
    let mut c = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    benv.apply(&mut c);
    c
}

fn demo(rest: &[String]) -> Res<()> {
    let benv = setup()?;
    run(cargo(&benv).args(["build", "--release", "-p", "sd-cli"]))?;
    let sd = root().join("target/release/sd");
    if !rest.is_empty() {
        return run(Command::new(&sd).args(rest));
    }
    // The default demo: list the devices, then generate with the built-in model.
    run(Command::new(&sd).arg("--list-devices"))?;
    let out = root().join("out");
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    run(Command::new(&sd).current_dir(root()).args([
        "-m",
        "models/builtin/sd-rs-shapes.safetensors",
        "-p",
        "a red circle on a white background",
        "-o",
        "out/demo.png",
    ]))
}

fn test(rest: &[String]) -> Res<()> {
    let benv = setup()?;
    run(cargo(&benv).args(["fmt", "--all", "--check"]))?;
    run(cargo(&benv).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    let mut t = cargo(&benv);
    t.args(["test", "--workspace"]).args(rest);
    run(&mut t)
}

fn bench(rest: &[String]) -> Res<()> {
    let benv = setup()?;
    let name = rest.first().map(String::as_str).unwrap_or("matmul");
    match name {
        "matmul" => run(cargo(&benv)
            .args(["bench", "-p", "sd-tensor", "--bench", "matmul", "--"])
            .args(&rest[1..])),
        "exec" => run(cargo(&benv)
            .args(["bench", "-p", "sd-exec", "--bench", "exec", "--"])
            .args(&rest[1..])),
        "upscale" => bench_upscale(&benv, &rest[1..]),
        other => Err(format!(
            "unknown benchmark '{other}' (known: matmul, exec, upscale)"
        )),
    }
}

/// `cargo xtask bench upscale [--size N] [--threads T] [--tile T]` (defaults 512, 2, 128):
/// a full-size Real-ESRGAN x4plus network (random weights) upscales an N x N image 4x in
/// tiles, with sd-rs (the release example `upscale_bench`) and with spandrel on PyTorch CPU
/// (`scripts/bench/upscale_bench.py`, same tiles), one after the other; prints both times
/// and their ratio.
fn bench_upscale(benv: &BuildEnv, args: &[String]) -> Res<()> {
    run(cargo(benv).args(["build", "--release", "--workspace", "--examples"]))?;
    let exe = root().join("target/release/examples/upscale_bench");
    let ours = capture(Command::new(&exe).args(args))?;
    let peer = capture(
        Command::new("python3")
            .arg(root().join("scripts/bench/upscale_bench.py"))
            .args(args),
    )?;
    let secs = |json: &str| -> Res<f64> {
        let v = json
            .split("\"seconds\": ")
            .nth(1)
            .and_then(|r| r.split([',', '}']).next())
            .ok_or_else(|| format!("no seconds in {json}"))?;
        v.trim().parse().map_err(|e| format!("{v}: {e}"))
    };
    let (a, b) = (secs(&ours)?, secs(&peer)?);
    println!("{}", ours.trim());
    println!("{}", peer.trim());
    println!(
        "upscale x4plus: sd-rs {a:.2} s, spandrel/PyTorch {b:.2} s, sd-rs time / PyTorch time = {:.2}",
        a / b
    );
    Ok(())
}

fn capture(cmd: &mut Command) -> Res<String> {
    eprintln!("+ {cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
