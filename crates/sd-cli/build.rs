//! Exports the dynamic symbols of `sd` and `sd-bench` (`-Wl,--export-dynamic`): ggml backend
//! modules loaded at run time (`libggml-cuda.so`, `libggml-vulkan.so`; see
//! `sd_tensor::ggml::load_backend_modules`) then bind their ggml calls to the one ggml
//! statically linked into the binary instead of a second copy.
//!
//! Also hands the ggml header directories (from ggml-sys's build metadata) to the tests,
//! which compile stub backend modules against them (`SDRS_GGML_INCLUDE`,
//! `SDRS_GGML_IMPL_INCLUDE`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for bin in ["sd", "sd-bench"] {
        println!("cargo:rustc-link-arg-bin={bin}=-Wl,--export-dynamic");
    }
    for (dep, var) in [
        ("DEP_SDRS_GGML_INCLUDE", "SDRS_GGML_INCLUDE"),
        ("DEP_SDRS_GGML_IMPL_INCLUDE", "SDRS_GGML_IMPL_INCLUDE"),
    ] {
        println!("cargo:rerun-if-env-changed={dep}");
        let v = std::env::var(dep).unwrap_or_default();
        println!("cargo:rustc-env={var}={v}");
    }
}
