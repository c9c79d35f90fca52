//! Exports `sd-bench`'s dynamic symbols (`-Wl,--export-dynamic`): ggml backend modules loaded
//! at run time (`libggml-cuda.so`, see `Device::load_module`) then bind their ggml calls to
//! the one ggml statically linked into the binary instead of a second copy.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-arg-bin=sd-bench=-Wl,--export-dynamic");
}
