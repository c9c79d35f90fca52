//! Backend modules loaded at start and the `--list-devices` listing.
//!
//! `sd` loads ggml backend modules (`libggml-cuda.so`, `libggml-vulkan.so`, built by
//! `cargo xtask build-cuda` / `build-vulkan`) once at start, from the directories or files in
//! `SD_BACKEND_MODULES` or, when that is unset, from the executable's directory. A module that
//! does not load is a warning naming the file and ggml's reason; `sd` goes on with the
//! devices it has.

use std::sync::OnceLock;

use sd_tensor::ggml::{load_backend_modules, Device, DeviceKind, ModuleOutcome, MODULES_ENV};

static MODULES: OnceLock<Vec<ModuleOutcome>> = OnceLock::new();

/// Loads the backend modules (once per process) and prints a warning for each that failed.
pub fn load_modules() {
    MODULES.get_or_init(|| {
        let out = load_backend_modules();
        for o in &out {
            if let Err(e) = &o.result {
                eprintln!("warning: {e}; its devices are not available");
            }
        }
        out
    });
}

/// The instruction-set extensions of this machine's CPU that ggml's CPU kernels can use, in
/// ggml's feature names, read from `/proc/cpuinfo` (empty elsewhere).
pub fn host_cpu_features() -> Vec<&'static str> {
    const MAP: &[(&str, &str)] = &[
        ("avx", "AVX"),
        ("avx2", "AVX2"),
        ("f16c", "F16C"),
        ("fma", "FMA"),
        ("bmi2", "BMI2"),
        ("avx_vnni", "AVX_VNNI"),
        ("avx512f", "AVX512"),
        ("avx512vbmi", "AVX512_VBMI"),
        ("avx512_vnni", "AVX512_VNNI"),
        ("avx512_bf16", "AVX512_BF16"),
        ("amx_bf16", "AMX_BF16"),
        ("amx_int8", "AMX_INT8"),
        ("asimd", "NEON"),
        ("asimdhp", "FP16_VA"),
        ("asimddp", "DOTPROD"),
        ("i8mm", "MATMUL_INT8"),
        ("sve", "SVE"),
        ("sme", "SME"),
    ];
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return Vec::new();
    };
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect())
        .unwrap_or_default();
    MAP.iter()
        .filter(|(f, _)| flags.contains(f))
        .map(|&(_, g)| g)
        .collect()
}

/// Whether ggml's CPU kernels were built with bf16 dot products (`AVX512_BF16`): bf16
/// weights (`--type bf16`) then multiply at about twice the f16 rate.
pub fn cpu_has_bf16_products() -> bool {
    Device::all().iter().any(|d| {
        d.kind() == DeviceKind::Cpu
            && d.features()
                .iter()
                .any(|(k, v)| k == "AVX512_BF16" && v == "1")
    })
}

/// Prints every device with its memory; for the CPU the instruction sets its kernels were
/// built with and those this CPU has beyond them; for a module's device, the module file.
pub fn list() {
    let devices = Device::all();
    println!(
        "ggml {}: {} device(s)",
        sd_tensor::ggml::version(),
        devices.len()
    );
    let modules = MODULES.get().map(Vec::as_slice).unwrap_or(&[]);
    for d in devices {
        let m = d.memory();
        println!(
            "  {:<8} {:?}  {}  free {} MiB / total {} MiB",
            d.name(),
            d.kind(),
            d.description(),
            m.free >> 20,
            m.total >> 20
        );
        let feats: Vec<String> = d
            .features()
            .into_iter()
            .map(|(k, v)| if v == "1" { k } else { format!("{k}={v}") })
            .collect();
        if d.kind() == DeviceKind::Cpu {
            println!("           kernels built for: {}", feats.join(" "));
            let missing: Vec<&str> = host_cpu_features()
                .into_iter()
                .filter(|f| !feats.iter().any(|g| g == f))
                .collect();
            if sd_tensor::ggml::cpu_amx_bf16() {
                println!(
                    "           bf16 weights (--type bf16) multiply on AMX tiles \
                     (this project's kernels; SD_AMX=0 turns them off)"
                );
            }
            let missing: Vec<&str> = missing.into_iter().filter(|f| *f != "AMX_BF16").collect();
            if !missing.is_empty() {
                println!(
                    "           this CPU also has {} (unused: ggml was not built for it; \
                     build with `-C target-cpu=native`, the default of .cargo/config.toml)",
                    missing.join(" ")
                );
            }
        } else if !feats.is_empty() {
            println!("           features: {}", feats.join(" "));
        }
        if let Some(o) = modules
            .iter()
            .find(|o| matches!(&o.result, Ok(devs) if devs.contains(&d.name())))
        {
            println!("           module: {}", o.path.display());
        }
    }
    for o in modules {
        match &o.result {
            Err(e) => println!("  not loaded: {e}"),
            // Loaded, but its runtime found no device (no GPU, or no driver for it: a
            // Vulkan module without an ICD, a CUDA module without a CUDA driver).
            Ok(devs) if devs.is_empty() => println!(
                "  loaded, no devices: {} (its runtime found no GPU or no driver for one)",
                o.path.display()
            ),
            Ok(_) => {}
        }
    }
    if modules.is_empty() {
        println!(
            "  (no GPU backend modules found: {} or the executable's directory; see README, GPU)",
            MODULES_ENV
        );
    }
}
