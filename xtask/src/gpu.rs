//! `cargo xtask build-cuda` / `build-vulkan`: ggml's CUDA or Vulkan backend as a module that
//! `sd` loads at start, built from the same ggml source the Rust build compiles (the
//! `llama-cpp-sys-2` package's `llama.cpp/ggml`).
//!
//! ```text
//! cargo xtask build-cuda [--arch 90[;89...]|native] [--out DIR] [--ggml-src DIR] [--no-sd] [-- CMAKE ARGS]
//! cargo xtask build-vulkan [--out DIR] [--ggml-src DIR] [--no-sd] [-- CMAKE ARGS]
//! ```
//!
//! It builds `sd` (release) unless `--no-sd`, configures ggml with `GGML_BACKEND_DL=ON`,
//! `BUILD_SHARED_LIBS=ON`, no CPU backend (the CPU backend is linked into `sd`), builds the one
//! module and puts it in `--out` (default `target/release`, next to `sd`) with an empty stub
//! `libggml-base.so.0`: the module's ggml calls then bind to the ggml inside `sd` (which
//! exports its symbols), found through the module's `$ORIGIN` run path. Copy `sd` and the
//! files beside it together to another machine (same ggml source, same build).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, root, run, setup, works, Res};

/// Which GPU backend to build.
#[derive(Clone, Copy, PartialEq)]
pub enum Gpu {
    Cuda,
    Vulkan,
}

struct Opts {
    arch: String,
    out: PathBuf,
    ggml_src: Option<PathBuf>,
    build_sd: bool,
    cmake_extra: Vec<String>,
}

fn parse(args: &[String]) -> Res<Opts> {
    let mut o = Opts {
        arch: "native".into(),
        out: root().join("target/release"),
        ggml_src: env_path("GGML_SRC"),
        build_sd: true,
        cmake_extra: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--arch" => o.arch = val("--arch")?,
            "--out" => o.out = PathBuf::from(val("--out")?),
            "--ggml-src" => o.ggml_src = Some(PathBuf::from(val("--ggml-src")?)),
            "--no-sd" => o.build_sd = false,
            "--" => {
                o.cmake_extra = it.by_ref().cloned().collect();
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

fn env_path(k: &str) -> Option<PathBuf> {
    std::env::var_os(k)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The `llama.cpp/ggml` directory of the `llama-cpp-sys-2` package the workspace uses.
fn find_ggml_src() -> Res<PathBuf> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root())
        .args(["metadata", "--format-version", "1"])
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // No JSON parser in xtask (it has no dependencies): the package's manifest path is the
    // one `"manifest_path":"..."` naming a `llama-cpp-sys-2-<version>` directory.
    for piece in text.split("\"manifest_path\":\"").skip(1) {
        let path = piece.split('"').next().unwrap_or("");
        if path.contains("/llama-cpp-sys-2-") {
            let dir = Path::new(path).parent().unwrap().join("llama.cpp/ggml");
            if dir.join("CMakeLists.txt").is_file() {
                return Ok(dir);
            }
        }
    }
    Err(
        "cannot find llama-cpp-sys-2's ggml source (run `cargo fetch`, or pass --ggml-src DIR)"
            .into(),
    )
}

/// Copies `src` to `dst` (once), adding the `ggml.pc.in` the crates.io package leaves out.
fn copy_src(src: &Path, dst: &Path) -> Res<()> {
    if !dst.join("CMakeLists.txt").is_file() {
        std::fs::create_dir_all(dst).map_err(|e| format!("{}: {e}", dst.display()))?;
        run(Command::new("cp").arg("-a").arg(src.join(".")).arg(dst))?;
    }
    let pc = dst.join("ggml.pc.in");
    if !pc.exists() {
        std::fs::write(&pc, "").map_err(|e| format!("{}: {e}", pc.display()))?;
    }
    Ok(())
}

fn find_nvcc() -> Option<PathBuf> {
    if works("nvcc", "--version") {
        return Some(PathBuf::from("nvcc"));
    }
    let p = env_path("CUDA_HOME")
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"))
        .join("bin/nvcc");
    p.is_file().then_some(p)
}

/// Installs the Vulkan headers and shader compiler with apt-get when root and they are
/// missing (not given to CMake either), else says how; CMake has the last word.
fn vulkan_prereqs(cmake_extra: &[String]) -> Res<()> {
    let headers = Path::new("/usr/include/vulkan/vulkan.h").exists()
        || std::env::var_os("VULKAN_SDK").is_some()
        || cmake_extra.iter().any(|a| a.contains("Vulkan_INCLUDE_DIR"));
    if headers && works("glslc", "--version") {
        return Ok(());
    }
    const PKGS: [&str; 3] = ["libvulkan-dev", "glslc", "spirv-headers"];
    if crate::is_root() && works("apt-get", "--version") {
        let installed = run(Command::new("apt-get").args(["update", "-qq"])).and_then(|_| {
            run(Command::new("apt-get")
                .args(["install", "-y", "-qq"])
                .args(PKGS)
                .env("DEBIAN_FRONTEND", "noninteractive"))
        });
        if let Err(e) = installed {
            eprintln!(
                "xtask: could not install {}: {e} (continuing)",
                PKGS.join(" ")
            );
        }
        return Ok(());
    }
    eprintln!(
        "xtask: the Vulkan headers or glslc may be missing; on Debian/Ubuntu: \
         sudo apt-get install {} (continuing: CMake says what it cannot find)",
        PKGS.join(" ")
    );
    Ok(())
}

/// `cargo xtask build-cuda` / `build-vulkan`.
pub fn build(gpu: Gpu, args: &[String]) -> Res<()> {
    let o = parse(args)?;
    let nvcc = match gpu {
        Gpu::Cuda => Some(find_nvcc().ok_or(
            "no CUDA compiler: nvcc is neither on PATH nor in $CUDA_HOME/bin (/usr/local/cuda)",
        )?),
        Gpu::Vulkan => None,
    };
    if o.build_sd {
        let benv = setup()?;
        run(cargo(&benv).args(["build", "--release", "-p", "sd-cli"]))?;
    } else if !works("cmake", "--version") {
        setup()?;
    }
    let (name, target) = match gpu {
        Gpu::Cuda => ("cuda", "ggml-cuda"),
        Gpu::Vulkan => ("vulkan", "ggml-vulkan"),
    };
    let src = match &o.ggml_src {
        Some(s) => s.clone(),
        None => find_ggml_src()?,
    };
    let work = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
        .join("ggml-modules");
    let src_copy = work.join("src");
    copy_src(&src, &src_copy)?;
    let build = work.join(format!("build-{name}"));

    let mut cfg = Command::new("cmake");
    cfg.arg("-S").arg(&src_copy).arg("-B").arg(&build);
    if works("ninja", "--version") {
        cfg.args(["-G", "Ninja"]);
    }
    cfg.args([
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_BACKEND_DL=ON",
        "-DGGML_CPU=OFF",
        "-DGGML_NATIVE=OFF",
        "-DGGML_BUILD_EXAMPLES=OFF",
        "-DGGML_BUILD_TESTS=OFF",
        "-DCMAKE_BUILD_RPATH=$ORIGIN",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    ]);
    match gpu {
        Gpu::Cuda => {
            if let Some(nvcc) = nvcc.filter(|n| n != Path::new("nvcc")) {
                cfg.env("CUDACXX", nvcc);
            }
            cfg.arg(format!("-DCMAKE_CUDA_ARCHITECTURES={}", o.arch))
                .args([
                    "-DGGML_CUDA=ON",
                    // CUDA graphs: a graph computed again with nothing moved is replayed
                    // as one launch (ggml's default is off outside llama.cpp's build).
                    "-DGGML_CUDA_GRAPHS=ON",
                    "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
                    "-DGGML_CUDA_NCCL=OFF",
                ]);
        }
        Gpu::Vulkan => {
            vulkan_prereqs(&o.cmake_extra)?;
            cfg.arg("-DGGML_VULKAN=ON");
        }
    }
    cfg.args(&o.cmake_extra);
    run(&mut cfg)?;
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    run(Command::new("cmake").arg("--build").arg(&build).args([
        "--target",
        target,
        "-j",
        &jobs.to_string(),
    ]))?;

    let lib = format!("lib{target}.so");
    let built = [build.join("bin").join(&lib), build.join("src").join(&lib)]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{lib} not found under {}", build.display()))?;
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let dest = o.out.join(&lib);
    std::fs::copy(&built, &dest).map_err(|e| format!("copy to {}: {e}", dest.display()))?;
    base_stub(&work, &o.out)?;
    eprintln!(
        "xtask: built {} (and the stub libggml-base.so.0 beside it); check with\n  \
         {}/sd --list-devices",
        dest.display(),
        o.out.display()
    );
    Ok(())
}

/// An empty `libggml-base.so.0`: satisfies the module's `NEEDED` entry while every ggml
/// symbol binds to the executable's own copy (a symbol `sd` lacks then fails the load).
fn base_stub(work: &Path, out: &Path) -> Res<()> {
    let c = work.join("ggml-base-stub.c");
    std::fs::write(
        &c,
        "/* empty: ggml's symbols come from the executable (-Wl,--export-dynamic) */\n\
         int sdrs_ggml_base_stub;\n",
    )
    .map_err(|e| format!("{}: {e}", c.display()))?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    run(Command::new(cc)
        .args(["-shared", "-fPIC", "-Wl,-soname,libggml-base.so.0", "-o"])
        .arg(out.join("libggml-base.so.0"))
        .arg(&c))
}
