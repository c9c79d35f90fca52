//! Generates the ggml bindings from the headers that `llama-cpp-sys-2` installs.
//!
//! `llama-cpp-sys-2` builds ggml with CMake and exports `DEP_LLAMA_GGML_CMAKE_DIR`
//! (`<out>/lib/cmake`); the installed headers sit in `<out>/include`.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEP_LLAMA_GGML_CMAKE_DIR");
    let cmake_dir = env::var("DEP_LLAMA_GGML_CMAKE_DIR")
        .expect("llama-cpp-sys-2 did not export DEP_LLAMA_GGML_CMAKE_DIR");
    let include = PathBuf::from(&cmake_dir).join("../../include");
    let include = include
        .canonicalize()
        .unwrap_or_else(|e| panic!("ggml include dir {} not found: {e}", include.display()));

    // ggml's backend interface header (not installed): the simulated device in sd-tensor
    // implements a buffer type and a backend through it. Found through the CMake cache.
    let cache = PathBuf::from(&cmake_dir).join("../../build/CMakeCache.txt");
    let src_root = std::fs::read_to_string(&cache)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("CMAKE_HOME_DIRECTORY:INTERNAL=")
                    .map(str::to_string)
            })
        })
        .unwrap_or_else(|| panic!("cannot find the ggml source dir in {}", cache.display()));
    let impl_dir = PathBuf::from(src_root).join("ggml/src");
    assert!(
        impl_dir.join("ggml-backend-impl.h").exists(),
        "ggml-backend-impl.h not found in {}",
        impl_dir.display()
    );

    let mut wrapper = String::from(
        "#include \"ggml.h\"\n#include \"ggml-alloc.h\"\n#include \"ggml-backend.h\"\n\
         #include \"ggml-cpu.h\"\n#include \"gguf.h\"\n#include \"ggml-backend-impl.h\"\n",
    );
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        wrapper.push_str("#include \"ggml-cuda.h\"\n");
    }
    if env::var_os("CARGO_FEATURE_RPC").is_some() {
        wrapper.push_str("#include \"ggml-rpc.h\"\n");
    }

    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let bindings = bindgen::Builder::default()
        .header_contents("sdrs_ggml_wrapper.h", &wrapper)
        .clang_arg(format!("-I{}", include.display()))
        .clang_arg(format!("-I{}", impl_dir.display()))
        .allowlist_item("ggml_.*|gguf_.*|GGML_.*|GGUF_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .expect("bindgen failed on the ggml headers");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("cannot write ggml bindings");
    println!("cargo:include={}", include.display());
    // ggml-backend-impl.h's directory: dependents' tests compile stub backend modules with it.
    println!("cargo:impl_include={}", impl_dir.display());
}
