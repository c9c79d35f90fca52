//! `sd` finds and loads ggml backend modules at start: a stub module compiled here with the
//! system C compiler against ggml's own headers (`ggml-backend-impl.h`) registers one device,
//! `STUB0`; it is found next to the executable or through `SD_BACKEND_MODULES`, listed by
//! `--list-devices` with its memory, and refused with a clear warning (never a crash) when it
//! needs a symbol `sd` does not export or reports another backend API version.
//!
//! The stub needs `libggml-base.so.0` (through its `$ORIGIN` run path, an empty stub as the
//! module builds of `cargo xtask build-cuda` ship) and calls `ggml_type_name`, so listing it
//! also proves that the module's ggml calls bind to the copy inside `sd`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const STUB_C: &str = r#"
#include <stdio.h>
#include "ggml.h"
#include "ggml-backend-impl.h"

#ifdef STUB_BAD_SYMBOL
const char * sdrs_symbol_sd_does_not_have(void);
#endif

static char desc[64];
static const char * dev_name(ggml_backend_dev_t d) { (void) d; return "STUB0"; }
static const char * dev_desc(ggml_backend_dev_t d) {
    (void) d;
#ifdef STUB_BAD_SYMBOL
    return sdrs_symbol_sd_does_not_have();
#else
    snprintf(desc, sizeof desc, "sd-rs stub module (%s)", ggml_type_name(GGML_TYPE_F16));
    return desc;
#endif
}
static void dev_memory(ggml_backend_dev_t d, size_t * free, size_t * total) {
    (void) d; *free = (size_t) 1000 << 20; *total = (size_t) 2048 << 20;
}
static enum ggml_backend_dev_type dev_type(ggml_backend_dev_t d) {
    (void) d; return GGML_BACKEND_DEVICE_TYPE_ACCEL;
}
static struct ggml_backend_device dev;
static const char * reg_name(ggml_backend_reg_t r) { (void) r; return "STUB"; }
#ifdef STUB_NO_DEVICES
static size_t reg_count(ggml_backend_reg_t r) { (void) r; return 0; }
#else
static size_t reg_count(ggml_backend_reg_t r) { (void) r; return 1; }
#endif
static ggml_backend_dev_t reg_get(ggml_backend_reg_t r, size_t i) { (void) r; (void) i; return &dev; }
static struct ggml_backend_reg reg;

static ggml_backend_reg_t stub_reg(void) {
    reg.api_version = GGML_BACKEND_API_VERSION + STUB_API_OFFSET;
    reg.iface.get_name = reg_name;
    reg.iface.get_device_count = reg_count;
    reg.iface.get_device = reg_get;
    dev.iface.get_name = dev_name;
    dev.iface.get_description = dev_desc;
    dev.iface.get_memory = dev_memory;
    dev.iface.get_type = dev_type;
    dev.reg = &reg;
    return &reg;
}
GGML_BACKEND_DL_IMPL(stub_reg)
"#;

fn sd() -> &'static str {
    env!("CARGO_BIN_EXE_sd")
}

/// A fresh directory under the target's test scratch space.
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("modules-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cc(args: &[&str]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(args)
        .output()
        .expect("system C compiler");
    assert!(
        out.status.success(),
        "{cc} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compiles the stub as `dir/libggml-<name>.so` next to an empty `libggml-base.so.0`.
fn build_stub(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let inc = env!("SDRS_GGML_INCLUDE");
    let imp = env!("SDRS_GGML_IMPL_INCLUDE");
    assert!(
        !inc.is_empty() && !imp.is_empty(),
        "ggml-sys gave no header dirs"
    );
    let src = dir.join("stub.c");
    std::fs::write(&src, STUB_C).unwrap();
    let base = dir.join("base.c");
    std::fs::write(&base, "int sdrs_ggml_base_stub;\n").unwrap();
    let base_so = dir.join("libggml-base.so.0");
    cc(&[
        "-shared",
        "-fPIC",
        "-Wl,-soname,libggml-base.so.0",
        "-o",
        base_so.to_str().unwrap(),
        base.to_str().unwrap(),
    ]);
    let out = dir.join(format!("libggml-{name}.so"));
    let mut args: Vec<String> = vec![
        "-shared".into(),
        "-fPIC".into(),
        "-DGGML_BACKEND_DL".into(),
        "-DGGML_BACKEND_BUILD".into(),
        "-DGGML_BACKEND_SHARED".into(),
        format!("-I{inc}"),
        format!("-I{imp}"),
        "-o".into(),
        out.to_str().unwrap().into(),
        src.to_str().unwrap().into(),
        "-Wl,-rpath,$ORIGIN".into(),
        base_so.to_str().unwrap().into(),
    ];
    args.extend(defines.iter().map(|d| d.to_string()));
    if !defines.iter().any(|d| d.starts_with("-DSTUB_API_OFFSET")) {
        args.push("-DSTUB_API_OFFSET=0".into());
    }
    cc(&args.iter().map(String::as_str).collect::<Vec<_>>());
    out
}

fn list_devices(exe: &str, modules: Option<&Path>) -> Output {
    let mut c = Command::new(exe);
    c.arg("--list-devices");
    match modules {
        Some(m) => c.env("SD_BACKEND_MODULES", m),
        None => c.env_remove("SD_BACKEND_MODULES"),
    };
    c.output().expect("run sd")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn stub_module_is_found_listed_and_bound_to_sds_ggml() {
    let dir = scratch("good");
    let module = build_stub(&dir, "stub", &[]);

    // Through SD_BACKEND_MODULES, as a directory and as a file.
    for spec in [dir.clone(), module.clone()] {
        let o = list_devices(sd(), Some(&spec));
        let (out, err) = text(&o);
        assert!(o.status.success(), "{out}\n{err}");
        assert!(!err.contains("warning"), "{err}");
        let line = out
            .lines()
            .find(|l| l.contains("STUB0"))
            .unwrap_or_else(|| panic!("STUB0 not listed with SD_BACKEND_MODULES={spec:?}:\n{out}"));
        assert!(line.contains("sd-rs stub module (f16)"), "{line}");
        assert!(line.contains("free 1000 MiB / total 2048 MiB"), "{line}");
        assert!(
            out.contains(&format!("module: {}", module.display())),
            "{out}"
        );
        assert!(
            out.lines().any(|l| l.trim_start().starts_with("CPU")),
            "{out}"
        );
    }

    // Next to the executable, with SD_BACKEND_MODULES unset (a hard link keeps the copy of
    // `sd` cheap; its directory is the link's).
    let exe = dir.join("sd");
    if std::fs::hard_link(sd(), &exe).is_err() {
        std::fs::copy(sd(), &exe).unwrap();
    }
    let o = list_devices(exe.to_str().unwrap(), None);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("STUB0"),
        "not found next to the executable:\n{out}\n{err}"
    );

    // Set but empty: no modules.
    let o = list_devices(exe.to_str().unwrap(), Some(Path::new("")));
    assert!(!text(&o).0.contains("STUB0"));
}

#[test]
fn mismatched_modules_are_refused_with_a_clear_warning() {
    let dir = scratch("bad");
    build_stub(&dir, "badsym", &["-DSTUB_BAD_SYMBOL"]);
    build_stub(&dir, "badapi", &["-DSTUB_API_OFFSET=100"]);
    let o = list_devices(sd(), Some(&dir));
    let (out, err) = text(&o);
    assert!(
        o.status.success(),
        "sd must go on without the modules:\n{out}\n{err}"
    );
    assert!(!out.contains("STUB0"), "{out}");
    assert!(
        out.lines().any(|l| l.trim_start().starts_with("CPU")),
        "{out}"
    );
    let warn = |name: &str| {
        err.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("no warning naming {name}:\n{err}"))
            .to_string()
    };
    let sym = warn("libggml-badsym.so");
    assert!(
        sym.starts_with("warning: cannot load ggml backend module"),
        "{sym}"
    );
    assert!(sym.contains("sdrs_symbol_sd_does_not_have"), "{sym}");
    let api = warn("libggml-badapi.so");
    assert!(api.contains("incompatible API version"), "{api}");
    assert!(
        out.contains("not loaded: cannot load ggml backend module"),
        "{out}"
    );

    // A module whose runtime finds no device (a Vulkan module without a driver): loaded,
    // listed as such, no warning.
    let none = scratch("nodev");
    build_stub(&none, "nodev", &["-DSTUB_NO_DEVICES"]);
    let o = list_devices(sd(), Some(&none));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.lines()
            .any(|l| l.contains("loaded, no devices") && l.contains("libggml-nodev.so")),
        "{out}"
    );
    assert!(!err.contains("warning"), "{err}");

    // A named file that does not exist.
    let o = list_devices(sd(), Some(&dir.join("libggml-cuda.so")));
    let (_, err) = text(&o);
    assert!(o.status.success());
    assert!(err.contains("libggml-cuda.so: no such file"), "{err}");
}
