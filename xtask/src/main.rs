//! `cargo xtask`: the project's entry points.
//!
//! - `cargo xtask demo`: the main job (bootstraps native build tools, builds `sd` in release
//!   mode, lists the devices and generates `out/demo.png` with the built-in model; extra
//!   arguments are passed to `sd` instead).
//! - `cargo xtask test`: the whole test run as CI does it (rustfmt, clippy, tests).
//! - `cargo xtask setup`: only installs what the ggml build needs (CMake, libclang).
//! - `cargo xtask bench <name>`: benchmarks (`matmul`, `exec`, `unet`: one SD1.5 UNet step in
//!   sd-rs and in diffusers, side by side, against the ggml matmul ceiling; `upscale`: tiled
//!   Real-ESRGAN x4 in sd-rs and in spandrel).
//! - `cargo xtask build-cuda [--arch 90]` / `cargo xtask build-vulkan`: `sd` plus ggml's CUDA or
//!   Vulkan backend as a module next to it, which `sd` loads at start (see `gpu.rs`).
//!
//! xtask itself has no dependencies, so it builds before CMake or libclang exist and can
//! install them: with apt-get when running as root, otherwise from PyPI with pip. For the
//! same reason it reads its few arguments by hand (a command and `--arch`), the one command
//! line of the workspace not parsed by clap; the binaries it runs parse theirs with clap.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

mod dit;
mod e2e;
mod gpu;

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    let result = match cmd {
        "setup" => setup().map(|_| ()),
        "demo" => demo(rest),
        "test" => test(rest),
        "bench" => bench(rest),
        "build-cuda" => gpu::build(gpu::Gpu::Cuda, rest),
        "build-vulkan" => gpu::build(gpu::Gpu::Vulkan, rest),
        _ => {
            eprintln!(
                "usage: cargo xtask <setup|demo|test|bench NAME|build-cuda [--arch 90]|build-vulkan>"
            );
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
        "unet" => bench_unet(&benv, &rest[1..]),
        "vae" => bench_vae(&benv, &rest[1..]),
        "upscale" => bench_upscale(&benv, &rest[1..]),
        "dit" => dit::bench(&benv, &rest[1..]),
        "e2e" => e2e::bench(&benv),
        other => Err(format!(
            "unknown benchmark '{other}' (known: matmul, exec, unet, vae, upscale, dit, e2e)"
        )),
    }
}

/// The rows of `bench unet` / `bench vae` for the weight types past f16: sd-rs's time
/// (`{w}_{ours}_seconds`) against the ggml matmul ceiling for `w` and each diffusers dtype
/// (`{theirs}_{dtype}_seconds`), `gflop` the run's matrix products.
fn weight_rows(
    results: &[(String, String)],
    weights: &[String],
    ours: &str,
    theirs: &str,
    gflop: f64,
    dtypes: &str,
) -> Res<()> {
    let get = |k: &str| result(results, k);
    for w in weights.iter().filter(|w| *w != "f16") {
        let t = get(&format!("{w}_{ours}_seconds"))?;
        let c = get(&format!("{w}_matmul_weights_gflops"))?;
        let cpu = get(&format!("{w}_{ours}_cpu_seconds"))?;
        println!(
            "  sd-rs, {w} weights ({w:4})   {t:8.2} s  {:6.1} GFLOP/s  {:5.1}% of the ggml {w} matmul ceiling ({c:.1} GFLOP/s)  CPU {cpu:.2} s",
            gflop / t,
            100.0 * gflop / t / c
        );
        for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
            let other = get(&format!("{theirs}_{dtype}_seconds"))?;
            println!("    sd-rs {w} / diffusers {dtype}: time {:.2}", t / other);
        }
    }
    Ok(())
}

/// The weight types of a `--weights` value: `f16`, `bf16`, `q8_0`, comma-separated (`f16`
/// always runs: it is the reference row).
fn weights_arg(v: Option<&str>, what: &str) -> Res<Vec<String>> {
    let v = v.ok_or_else(|| format!("{what}: --weights needs a list of f16, bf16, q8_0"))?;
    let mut out = vec!["f16".to_string()];
    for w in v.split(',') {
        match w {
            "f16" => {}
            "bf16" | "q8_0" => out.push(w.to_string()),
            _ => return Err(format!("{what}: --weights {v}: a list of f16, bf16, q8_0")),
        }
    }
    Ok(out)
}

/// Runs `cmd`, echoing its output, and returns the `RESULT key=value` lines it printed.
fn run_results(cmd: &mut Command) -> Res<Vec<(String, String)>> {
    eprintln!("+ {cmd:?}");
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    if !out.status.success() {
        return Err(format!("{cmd:?} failed with {}", out.status));
    }
    Ok(text
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

/// `cargo xtask bench unet`: one SD1.5 UNet step (random weights, batch 2, 64x64 latent,
/// 77x768 context) in sd-rs on the ggml CPU backend (f16 weights,
/// `crates/sd-models/benches/unet_step.rs`, which also measures the ggml f16 matmul
/// ceiling; once on the project's CPU kernels as `sd` runs, once on ggml's ops only with
/// flash attention, once on the kernels with ggml's f16 product for convolutions (after the
/// im2col) and linear layers, `SD_F32_PRODUCTS=0`), then in diffusers on PyTorch CPU (`scripts/bench/unet_step_diffusers.py`, f32
/// and bf16), on the same thread count (`SD_BENCH_THREADS`, default 2); prints the times,
/// the ratios and GFLOP/s against the ceiling. `SD_BENCH_TORCH_DTYPES` (default `f32,bf16`)
/// picks the PyTorch runs, `SD_BENCH_REPS` (default 2) the timed steps of each.
/// `--model sdxl` runs the SDXL base UNet instead (1024x1024: 128x128 latent, 77x2048
/// context, `y` of 2816); `--latent N` sets the latent side of either; `--weights f16,bf16`
/// adds a run of the kernels with bf16 weights (`sd --type bf16`), against the bf16 matmul
/// ceiling and diffusers.
fn bench_unet(benv: &BuildEnv, args: &[String]) -> Res<()> {
    let mut model = "sd15".to_string();
    let mut latent: Option<String> = None;
    let mut weights = vec!["f16".to_string()];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = it.next().cloned().ok_or("--model needs sd15 or sdxl")?,
            "--latent" => latent = Some(it.next().cloned().ok_or("--latent needs a size")?),
            "--weights" => {
                weights = weights_arg(it.next().map(String::as_str), "bench unet")?;
            }
            other => {
                return Err(format!(
                    "bench unet: unknown argument '{other}' (--model, --latent, --weights)"
                ))
            }
        }
    }
    if model != "sd15" && model != "sdxl" {
        return Err(format!("bench unet: --model {model}: sd15 or sdxl"));
    }
    let side = latent.unwrap_or_else(|| if model == "sdxl" { "128" } else { "64" }.into());
    if side.parse::<u32>().map_or(true, |n| n == 0 || n % 8 != 0) {
        return Err(format!(
            "bench unet: --latent {side}: a positive multiple of 8"
        ));
    }
    let (threads, reps, dtypes) = bench_env();
    // The project's CPU kernels (what `sd` runs), then ggml's ops only with flash attention
    // (`fa_` keys: stable-diffusion.cpp's CPU path with `--diffusion-fa`).
    let mut results = Vec::new();
    // Then the kernels with each other weight type asked for (`bf16_` keys, ...).
    // And the kernels with ggml's f16 product for convolutions and linear layers
    // (`SD_F32_PRODUCTS=0`, `f16mm_` keys).
    let runs = [
        ("1", "f16", String::new(), "1"),
        ("0", "f16", "fa_".into(), "1"),
        ("1", "f16", "f16mm_".into(), "0"),
    ]
    .into_iter()
    .chain(
        weights
            .iter()
            .filter(|w| *w != "f16")
            .map(|w| ("1", w.as_str(), format!("{w}_"), "1")),
    );
    for (host, w, prefix, f32_products) in runs {
        let r = run_results(
            cargo(benv)
                .args(["bench", "--workspace", "--bench", "unet_step"])
                .env("SD_BENCH_THREADS", &threads)
                .env("SD_BENCH_REPS", &reps)
                .env("SD_BENCH_MODEL", &model)
                .env("SD_BENCH_LATENT", &side)
                .env("SD_BENCH_HOST_KERNELS", host)
                .env("SD_BENCH_WEIGHTS", w)
                .env("SD_F32_PRODUCTS", f32_products)
                .env("SD_BENCH_FLASH_ATTN", "1"),
        )?;
        results.extend(r.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)));
    }
    let script = root().join("scripts/bench/unet_step_diffusers.py");
    for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
        let mut py = Command::new("python3");
        py.arg(&script)
            .args(["--threads", &threads, "--dtype", dtype, "--reps", &reps])
            .args(["--model", &model, "--latent", &side]);
        results.extend(run_results(&mut py)?);
    }
    let get = |k: &str| result(&results, k);
    let ours = get("ggml_unet_seconds")?;
    let ours_cpu = get("ggml_unet_cpu_seconds")?;
    let gflop = get("unet_gflop")?;
    let ceiling = get("matmul_f16_gflops")?;
    println!();
    let label = if model == "sdxl" { "SDXL" } else { "SD1.5" };
    println!("{label} UNet step, batch 2, {side}x{side} latent, {threads} CPU threads ({gflop:.0} GFLOP of matrix products)");
    println!(
        "  sd-rs (CPU kernels, as sd)  {ours:8.2} s  {:6.1} GFLOP/s  {:5.1}% of the ggml f16 matmul ceiling ({ceiling:.1} GFLOP/s)  CPU {ours_cpu:.2} s",
        gflop / ours,
        100.0 * gflop / ours / ceiling
    );
    let fa = get("fa_ggml_unet_seconds")?;
    let fa_cpu = get("fa_ggml_unet_cpu_seconds")?;
    let fa_ceiling = get("fa_matmul_f16_gflops")?;
    println!(
        "  sd-rs, ggml ops + flash     {fa:8.2} s  {:6.1} GFLOP/s  {:5.1}% of the ceiling measured in its run ({fa_ceiling:.1} GFLOP/s)  CPU {fa_cpu:.2} s",
        gflop / fa,
        100.0 * gflop / fa / fa_ceiling
    );
    let f16mm = get("f16mm_ggml_unet_seconds")?;
    println!(
        "  sd-rs, ggml's f16 product   {f16mm:8.2} s  {:6.1} GFLOP/s  (SD_F32_PRODUCTS=0; f32 products / f16: {:.3})",
        gflop / f16mm,
        ours / f16mm
    );
    weight_rows(&results, &weights, "ggml_unet", "torch", gflop, &dtypes)?;
    for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
        let theirs = get(&format!("torch_{dtype}_seconds"))?;
        let theirs_cpu = get(&format!("torch_{dtype}_cpu_seconds"))?;
        println!(
            "  diffusers (torch, {dtype:4})    {theirs:8.2} s  {:6.1} GFLOP/s  {:5.1}% of the ceiling  CPU {theirs_cpu:.2} s",
            gflop / theirs,
            100.0 * gflop / theirs / ceiling,
        );
        println!(
            "    sd-rs / diffusers {dtype}: time {:.2} (CPU time {:.2}); ggml ops + flash: time {:.2} (CPU time {:.2})",
            ours / theirs,
            ours_cpu / theirs_cpu,
            fa / theirs,
            fa_cpu / theirs_cpu
        );
    }
    for k in ["load_start", "fa_load_end"] {
        if let Some((_, v)) = results.iter().find(|(key, _)| key == k) {
            println!("  {k} (1/5/15 min load average): {v}");
        }
    }
    Ok(())
}
/// `cargo xtask bench vae`: one SD1.5 VAE decode (random f16 weights, a 64x64 latent to
/// 512x512) in sd-rs on the ggml CPU backend as `sd` runs it (`crates/sd-models/benches/
/// vae_decode.rs`: the project's CPU convolution kernels, then ggml's own for comparison, then
/// the kernels with ggml's f16 product after the im2col, `SD_F32_PRODUCTS=0`), then in
/// diffusers on PyTorch CPU (`scripts/bench/vae_decode_diffusers.py`, f32 and bf16),
/// on the same thread count (`SD_BENCH_THREADS`, default 2); prints the times and ratios.
/// `SD_BENCH_TORCH_DTYPES` (default `f32,bf16`), `SD_BENCH_REPS` (default 2) and
/// `SD_BENCH_LATENT` (default 64) as for `bench unet`; `--weights f16,bf16` adds a decode
/// with bf16 weights.
fn bench_vae(benv: &BuildEnv, args: &[String]) -> Res<()> {
    let mut weights = vec!["f16".to_string()];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--weights" => weights = weights_arg(it.next().map(String::as_str), "bench vae")?,
            other => return Err(format!("bench vae: unknown argument '{other}' (--weights)")),
        }
    }
    let (threads, reps, dtypes) = bench_env();
    let side = env::var("SD_BENCH_LATENT").unwrap_or_else(|_| "64".into());
    let mut results = Vec::new();
    let runs = [
        ("1", "f16", String::new(), "1"),
        ("0", "f16", "ggml_im2col_".into(), "1"),
        ("1", "f16", "f16mm_".into(), "0"),
    ]
    .into_iter()
    .chain(
        weights
            .iter()
            .filter(|w| *w != "f16")
            .map(|w| ("1", w.as_str(), format!("{w}_"), "1")),
    );
    for (host, w, prefix, f32_products) in runs {
        let r = run_results(
            cargo(benv)
                .args(["bench", "--workspace", "--bench", "vae_decode"])
                .env("SD_BENCH_THREADS", &threads)
                .env("SD_BENCH_REPS", &reps)
                .env("SD_BENCH_LATENT", &side)
                .env("SD_BENCH_WEIGHTS", w)
                .env("SD_F32_PRODUCTS", f32_products)
                .env("SD_BENCH_HOST_KERNELS", host),
        )?;
        results.extend(r.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)));
    }
    let script = root().join("scripts/bench/vae_decode_diffusers.py");
    for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
        let mut py = Command::new("python3");
        py.arg(&script)
            .args(["--threads", &threads, "--dtype", dtype, "--reps", &reps])
            .args(["--latent", &side]);
        results.extend(run_results(&mut py)?);
    }
    let get = |k: &str| result(&results, k);
    let ours = get("ggml_vae_seconds")?;
    let plain = get("ggml_im2col_ggml_vae_seconds")?;
    let gflop = get("vae_gflop")?;
    let ceiling = get("matmul_f16_gflops")?;
    println!();
    println!("SD1.5 VAE decode, {side}x{side} latent, {threads} CPU threads ({gflop:.0} GFLOP of matrix products)");
    println!(
        "  sd-rs (as `sd` runs it)      {ours:8.2} s  {:6.1} GFLOP/s  {:5.1}% of the ggml f16 matmul ceiling ({ceiling:.1} GFLOP/s)",
        gflop / ours,
        100.0 * gflop / ours / ceiling
    );
    println!(
        "  sd-rs, ggml's own im2col     {plain:8.2} s  {:6.1} GFLOP/s",
        gflop / plain
    );
    let f16mm = get("f16mm_ggml_vae_seconds")?;
    println!(
        "  sd-rs, ggml's f16 product    {f16mm:8.2} s  {:6.1} GFLOP/s  (SD_F32_PRODUCTS=0; f32 products / f16: {:.3})",
        gflop / f16mm,
        ours / f16mm
    );
    weight_rows(&results, &weights, "ggml_vae", "torch_vae", gflop, &dtypes)?;
    for dtype in dtypes.split(',').filter(|d| !d.is_empty()) {
        let theirs = get(&format!("torch_vae_{dtype}_seconds"))?;
        println!(
            "  diffusers (torch, {dtype:4})     {theirs:8.2} s  {:6.1} GFLOP/s   sd-rs / diffusers {dtype}: {:.2}",
            gflop / theirs,
            ours / theirs
        );
    }
    Ok(())
}

/// The model benchmarks' environment: `SD_BENCH_THREADS` (default 2), `SD_BENCH_REPS`
/// (default 2), `SD_BENCH_TORCH_DTYPES` (default `f32,bf16`).
fn bench_env() -> (String, String, String) {
    let var = |k: &str, d: &str| env::var(k).unwrap_or_else(|_| d.into());
    (
        var("SD_BENCH_THREADS", "2"),
        var("SD_BENCH_REPS", "2"),
        var("SD_BENCH_TORCH_DTYPES", "f32,bf16"),
    )
}

/// The last `RESULT key=value` printed under `key`, as a number.
fn result(results: &[(String, String)], key: &str) -> Res<f64> {
    results
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.parse().ok())
        .ok_or_else(|| format!("no result {key}"))
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
    let secs = |json: &str| dit::json_number(json, "seconds");
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
