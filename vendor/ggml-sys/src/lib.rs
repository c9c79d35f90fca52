//! Raw FFI bindings to ggml: `ggml.h`, `ggml-alloc.h`, `ggml-backend.h`, `ggml-cpu.h`, `gguf.h`
//! (plus `ggml-cuda.h` and `ggml-rpc.h` behind the `cuda` and `rpc` features).
//!
//! # Where ggml comes from
//! ggml's source is not in this repository. It comes from the crates.io package
//! `llama-cpp-sys-2` (pinned to `=0.1.161`, ggml 0.26, backend API 3), which vendors a current
//! llama.cpp and builds it with CMake. We build it with `default-features = false` (no
//! `common` library) and run bindgen over the ggml headers it installs.
//!
//! Why this package: it is the only crates.io package that ships a current ggml (scheduler,
//! `gguf`, `flash_attn_ext`, `conv_2d_direct`, backend devices, RPC); the older `ggml-sys` and
//! `ggml-sys-bleedingedge` predate ggml-backend's device API, and `whisper-rs-sys` ships an
//! older ggml with no exported headers. Its cost is compiling llama.cpp's own sources too
//! (about 75 s of a ~2.5 min clean build on 2 cores); unused llama objects are dropped at
//! link time. Building needs CMake and libclang; `cargo xtask` installs them when missing.
//!
//! Nothing above `sd-tensor` may use this crate: the safe layer there owns every raw pointer.
// bindgen output: the C headers are the documentation.
#![allow(missing_docs)]
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(dead_code)]
#![allow(clippy::all)]
#![allow(rustdoc::broken_intra_doc_links)]
#![allow(rustdoc::invalid_html_tags)]
#![allow(rustdoc::bare_urls)]

// Referencing the crate keeps its static ggml libraries on the link line.
extern crate llama_cpp_sys_2;

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
